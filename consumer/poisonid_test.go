package consumer_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/consumer"
)

// paymentID derives a message id from the payment it carries, as the
// README advises when producers may re-publish under a new message-id. It
// panics on {"payment":null}, a poison message.
func paymentID(m consumer.Message) (string, error) {
	var v struct {
		Payment *struct {
			ID string `json:"id"`
		} `json:"payment"`
	}
	if err := json.Unmarshal(m.Value, &v); err != nil {
		return "", err
	}
	return "payment:" + v.Payment.ID, nil
}

func payment(offset int64, body string) consumer.Message {
	return consumer.Message{Topic: "payments", Offset: offset, Value: []byte(body)}
}

// A MessageID function that panics on a poison message must not kill the
// process (every restart would meet the message again and die with it,
// G6): the message is dead-lettered as one without a usable id, and its
// partition moves on. In each mode.
func TestAPanickingMessageIDDeadLettersThePoisonMessage(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"per message", "batch"} {
		t.Run(mode, func(t *testing.T) {
			b := setup(t)
			cfg := &consumer.Config{Schema: b.schema, MessageID: paymentID}
			var p *consumer.Processor
			var err error
			if mode == "batch" {
				p, err = consumer.NewBatch(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
					for _, m := range msgs {
						if err := b.record(ctx, tx, "ledger", m); err != nil {
							return err
						}
					}
					return nil
				}, cfg)
			} else {
				p, err = consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
					return b.record(ctx, tx, "ledger", m)
				}, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			tr := &memTransport{}
			run(t, p, tr, payment(0, `{"payment":{"id":"a"}}`), payment(1, `{"payment":null}`), payment(2, `{"payment":{"id":"b"}}`))
			dead := tr.deadLetters()
			if len(dead) != 1 || dead[0].Message.Offset != 1 {
				t.Fatalf("dead letters %+v, want the poison message's alone", dead)
			}
			if !errors.Is(dead[0].Err, consumer.ErrNoMessageID) || !strings.Contains(dead[0].Err.Error(), "panic") {
				t.Fatalf("dead letter's error %v, want ErrNoMessageID naming the panic", dead[0].Err)
			}
			if n := b.processedRows(t, "ledger"); n != 2 {
				t.Fatalf("%d messages processed, want the 2 good ones", n)
			}
		})
	}
}

// A DeadLetterTopic function that panics on a message must not kill the
// process either: its dead letter goes to the default "<topic>.dlq".
func TestAPanickingDeadLetterTopicFallsBackToTheDefault(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		return consumer.Permanent(errors.New("refused"))
	}, &consumer.Config{Schema: b.schema, DeadLetterTopic: func(m consumer.Message) string {
		var v struct{ Region *string }
		_ = json.Unmarshal(m.Value, &v)
		return "dlq-" + *v.Region // panics without a region
	}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &memTransport{}
	run(t, p, tr, msg(0, "id-0", ""))
	if dead := tr.deadLetters(); len(dead) != 1 || dead[0].Topic != "orders.dlq" {
		t.Fatalf("dead letters %+v, want one to orders.dlq", dead)
	}
}

// sizeLimitedTransport refuses dead letters over limit bytes (key, value
// and headers) as too large, as a dead-letter topic's max.message.bytes
// does.
type sizeLimitedTransport struct {
	memTransport
	limit int
}

func (s *sizeLimitedTransport) PublishDeadLetter(ctx context.Context, d consumer.DeadLetter) error {
	if err := s.refuseSize(d); err != nil {
		return err
	}
	return s.memTransport.PublishDeadLetter(ctx, d)
}

// refuseSize is the refusal of d, if it is over the limit.
func (s *sizeLimitedTransport) refuseSize(d consumer.DeadLetter) error {
	n := len(d.Key) + len(d.Value)
	for _, h := range d.Headers {
		n += len(h.Key) + len(h.Value)
	}
	if n > s.limit {
		return fmt.Errorf("%w: %d bytes", consumer.ErrDeadLetterTooLarge, n)
	}
	return nil
}

// A dead letter its topic refuses for its size goes out without the
// original's value (empty, not null: a null value is a tombstone on a
// compacted topic), then without the original's headers but its message
// id (an "onceflow-" header of the original's too), then with its long key
// replaced by the key's SHA-256 in hex (not null: a compacted topic refuses
// a record without a key), rather than stop the partition for good (G6); a
// long error is cut.
func TestADeadLetterTooLargeForItsTopicGoesOutSmaller(t *testing.T) {
	b := setup(t)
	p, err := consumer.New(b.pool, "ledger", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if m.Offset == 0 {
			return consumer.Permanent(errors.New(strings.Repeat("a very long reason ", 5000)))
		}
		return b.record(ctx, tx, "ledger", m)
	}, &consumer.Config{Schema: b.schema})
	if err != nil {
		t.Fatal(err)
	}
	key := strings.Repeat("k", 20_000)
	sum := sha256.Sum256([]byte(key))
	hashedKey := hex.EncodeToString(sum[:])
	big := msg(0, "id-0", key)
	big.Value = bytes.Repeat([]byte("v"), 500)
	big.Headers = append(big.Headers, consumer.Header{Key: "trace", Value: bytes.Repeat([]byte("t"), 20_000)},
		consumer.Header{Key: "onceflow-bad-headers", Value: bytes.Repeat([]byte("b"), 20_000)})
	tr := &sizeLimitedTransport{limit: 12_000}
	w := start(t, p, tr, big, msg(1, "id-1", key))
	defer w.Stop(context.Background())
	waitFor(t, 30*time.Second, "offset 1 marked done", func() bool { return tr.lastMark() == 1 })
	dead := tr.deadLetters()
	if len(dead) != 1 {
		t.Fatalf("dead letters %d, want 1", len(dead))
	}
	h := map[string]string{}
	for _, x := range dead[0].Headers {
		h[x.Key] = string(x.Value)
	}
	if dead[0].Value == nil || len(dead[0].Value) != 0 || h[consumer.HeaderDLQValueOmitted] != "500" || h["trace"] != "" || h["onceflow-bad-headers"] != "" ||
		h[consumer.MessageIDHeader] != "id-0" || string(dead[0].Key) != hashedKey || h[consumer.HeaderDLQTopic] != "orders" {
		t.Fatalf("dead letter: value %d bytes (nil %v), headers %d, omitted %q, id %q, key %.80q; want an empty value, no original header but its id, the value's size, the key's SHA-256 in hex",
			len(dead[0].Value), dead[0].Value == nil, len(dead[0].Headers), h[consumer.HeaderDLQValueOmitted], h[consumer.MessageIDHeader], dead[0].Key)
	}
	if e := h[consumer.HeaderDLQError]; len(e) > 8<<10+32 || !strings.HasPrefix(e, "permanent: a very long reason") {
		t.Fatalf("error header of %d bytes, want the reason's first 8 KiB", len(e))
	}
}
