package outbox

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/migrations"
)

// MessageIDHeader is the record header carrying an event's id. The relay sets
// it on every record; it is reserved in Message.Headers.
const MessageIDHeader = "message-id"

// Message is one event to publish.
type Message struct {
	// ID is the event's id, published as the message-id header: a UUID in
	// its text form, stored as a uuid and so published in its canonical
	// lower-case form whatever case it is written in. Empty lets the
	// database choose a random one. Choose it yourself when the consumer
	// should deduplicate on a business identity; Write refuses the nil UUID
	// (what an unset uuid.UUID formats to) and one id twice on one topic in
	// a call, since consumers would drop all but the first. One id on
	// several topics is one event fanned out.
	ID string
	// Topic is the Kafka topic. Required.
	Topic string
	// Key decides the partition and the ordering: events with the same key
	// are published in the order they were written. Nil publishes without a
	// key (no ordering promise).
	Key []byte
	// Value is the record value; nil publishes a null value (a tombstone).
	Value []byte
	// Headers become record headers. "message-id" is reserved. Names and
	// values are UTF-8 text without NUL (they are stored as jsonb): encode
	// binary values, e.g. in base64.
	Headers map[string]string
}

// DB is what Write needs: pgx.Tx, *pgx.Conn and *pgxpool.Pool all satisfy it.
// Pass the transaction that writes your business rows to get G1.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Config configures a Writer. The zero value is usable.
type Config struct {
	// Schema holds onceflow's tables. Defaults to "onceflow".
	Schema string
	// Inject adds headers taken from Write's context to every message, such
	// as the W3C trace context (traceparent, tracestate, baggage) that
	// otelonceflow.NewInjector's Injector records, so the consumer's span joins the
	// producer's trace. A header the message sets itself wins over an
	// injected one, and an injected "message-id" is ignored. The trace
	// context is one unit: a message that sets its own traceparent or
	// tracestate (forwarding another trace's context) gets none of the
	// injected traceparent, tracestate and baggage; one that sets only
	// baggage keeps it and still gets the injected trace context. Injected
	// headers must be text like the message's own: Write refuses a message
	// that would carry one that is not with ErrInvalidMessage. Defaults to
	// nil: no header is added.
	Inject Injector
}

// Injector adds headers derived from ctx (a trace context, say) to h, which
// it may only add to. Names and values must be UTF-8 text without NUL, as
// in Message.Headers. It is called once per Write call that has messages,
// so it must be safe for concurrent use.
type Injector interface {
	InjectHeaders(ctx context.Context, h map[string]string)
}

// Writer writes events into one schema's outbox. It is safe for concurrent
// use and holds no connection.
type Writer struct {
	insertSQL string
	inject    Injector
}

// NewWriter returns a Writer; cfg may be nil.
func NewWriter(cfg *Config) (*Writer, error) {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = migrations.DefaultSchema
	}
	if err := migrations.ValidateSchema(c.Schema); err != nil {
		return nil, fmt.Errorf("outbox: Config.Schema: %w", err)
	}
	table := pgx.Identifier{c.Schema, "outbox"}.Sanitize()
	// unnest keeps the argument order, and WITH ORDINALITY … ORDER BY makes
	// that explicit, so ids follow the order of msgs.
	return &Writer{inject: c.Inject, insertSQL: `INSERT INTO ` + table + ` (event_id, topic, key, value, headers)
SELECT coalesce(m.event_id, gen_random_uuid()), m.topic, m.key, m.value, m.headers::jsonb
FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::bytea[], $5::text[]) WITH ORDINALITY
     AS m(event_id, topic, key, value, headers, n)
ORDER BY m.n`}, nil
}

var defaultWriter, _ = NewWriter(nil)

// Write inserts msgs into the "onceflow" schema's outbox with one statement
// (one round trip, however many messages). With a transaction, the events
// exist if and only if it commits, and an idle relay finds them within its
// probe interval (5 ms by default) of the commit; one whose transaction
// commits more than 20 probe intervals after this call, once a newer event
// was published, within the relay's PollInterval (250 ms by default).
// With a pool or a connection outside a transaction each call commits on its
// own, so the events can outlive a business change that later fails.
func Write(ctx context.Context, db DB, msgs ...Message) error {
	return defaultWriter.Write(ctx, db, msgs...)
}

// Write inserts msgs into the Writer's outbox with one statement; see the
// package-level Write.
func (w *Writer) Write(ctx context.Context, db DB, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ids := make([]*string, len(msgs))
	topics := make([]string, len(msgs))
	keys := make([][]byte, len(msgs))
	values := make([][]byte, len(msgs))
	headers := make([]*string, len(msgs))
	var injected map[string]string
	// notText lists the injected headers that are not text, checked once:
	// the injector's headers are the same for every message, and a message
	// that does not use the injected one (usesInjected) may do without.
	var notText []string
	if w.inject != nil {
		injected = make(map[string]string, 3)
		w.inject.InjectHeaders(ctx, injected)
		delete(injected, MessageIDHeader)
		for k, v := range injected {
			if !isText(k) || !isText(v) {
				notText = append(notText, k)
			}
		}
		slices.Sort(notText)
	}
	// Consumers deduplicate on the id, so an id written twice to one topic
	// would lose the second event; one id on two topics is one event fanned
	// out. firstOf maps each chosen (id, topic) to its message's index.
	var firstOf map[idTopic]int
	for i, m := range msgs {
		if err := validate(m); err != nil {
			return fmt.Errorf("outbox: message %d: %w", i, err)
		}
		for _, k := range notText {
			if usesInjected(m.Headers, k) {
				return fmt.Errorf("outbox: message %d: %w: injected header %q (Config.Inject): %s", i, ErrInvalidMessage, k, notTextReason)
			}
		}
		if m.ID != "" && len(msgs) > 1 {
			if firstOf == nil {
				firstOf = make(map[idTopic]int, len(msgs))
			}
			// The column is uuid: an upper-case id is the same id.
			k := idTopic{strings.ToLower(m.ID), m.Topic}
			if j, ok := firstOf[k]; ok {
				return fmt.Errorf("outbox: message %d: %w: ID %s on topic %q repeats message %d's (consumers would drop one as a duplicate)", i, ErrInvalidMessage, k.id, m.Topic, j)
			}
			firstOf[k] = i
		}
		m.Headers = withInjected(m.Headers, injected)
		if m.ID != "" {
			id := m.ID
			ids[i] = &id
		}
		topics[i] = m.Topic
		keys[i] = m.Key
		values[i] = m.Value
		if len(m.Headers) > 0 {
			b, err := json.Marshal(m.Headers)
			if err != nil {
				return fmt.Errorf("outbox: message %d: encode headers: %w", i, err)
			}
			s := string(b)
			headers[i] = &s
		}
	}
	if _, err := db.Exec(ctx, w.insertSQL, ids, topics, keys, values, headers); err != nil {
		return fmt.Errorf("outbox: write %d messages: %w", len(msgs), err)
	}
	return nil
}

type idTopic struct{ id, topic string }

// withInjected returns h with the injected headers it does not set itself,
// leaving h as it was. traceparent and tracestate are one unit (W3C Trace
// Context: a tracestate belongs to its traceparent's trace), and baggage
// goes with them: a message that sets either of the two forwards a trace
// context of its own and gets none of the three injected. Other headers
// are taken one by one.
func withInjected(h, injected map[string]string) map[string]string {
	if len(injected) == 0 {
		return h
	}
	out := make(map[string]string, len(h)+len(injected))
	for k, v := range injected {
		if usesInjected(h, k) {
			out[k] = v
		}
	}
	for k, v := range h {
		out[k] = v
	}
	return out
}

// usesInjected reports whether a message with headers h takes the
// injected header k (see withInjected).
func usesInjected(h map[string]string, k string) bool {
	if _, own := h[k]; own {
		return false
	}
	switch k {
	case traceparentHeader, tracestateHeader, baggageHeader:
		_, tp := h[traceparentHeader]
		_, ts := h[tracestateHeader]
		return !tp && !ts
	}
	return true
}

// The W3C Trace Context and Baggage headers (see withInjected).
const (
	traceparentHeader = "traceparent"
	tracestateHeader  = "tracestate"
	baggageHeader     = "baggage"
)

// NewID returns a random (version 4) UUID for Message.ID.
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// ErrInvalidMessage is wrapped by every validation error of Write.
var ErrInvalidMessage = errors.New("invalid message")

func validate(m Message) error {
	if err := ValidateTopic(m.Topic); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidMessage, err)
	}
	if m.ID != "" && !isUUID(m.ID) {
		return fmt.Errorf("%w: ID %q is not a UUID", ErrInvalidMessage, m.ID)
	}
	// An unset uuid.UUID{} formats to the nil UUID: every event written
	// with it would share one id, and consumers would keep only the first.
	if m.ID == nilUUID {
		return fmt.Errorf("%w: ID is the nil UUID %s (an unset uuid.UUID?); leave ID empty for a random one", ErrInvalidMessage, nilUUID)
	}
	if _, ok := m.Headers[MessageIDHeader]; ok {
		return fmt.Errorf("%w: header %q is reserved; set Message.ID instead", ErrInvalidMessage, MessageIDHeader)
	}
	// The headers are stored as jsonb, which holds UTF-8 text without NUL:
	// other bytes would be replaced (a binary value lost silently) or
	// refused by PostgreSQL.
	for k, v := range m.Headers {
		if !isText(k) || !isText(v) {
			return fmt.Errorf("%w: header %q: %s", ErrInvalidMessage, k, notTextReason)
		}
	}
	return nil
}

const notTextReason = "names and values must be UTF-8 text without NUL (encode binary values, e.g. in base64)"

// isText reports whether jsonb stores s unchanged: UTF-8 without NUL.
func isText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// ValidateTopic checks a name against Kafka's topic rules.
func ValidateTopic(topic string) error {
	switch {
	case topic == "":
		return errors.New("topic is empty")
	case len(topic) > 249:
		return fmt.Errorf("topic %.20q… is longer than 249 characters", topic)
	case topic == "." || topic == "..":
		return fmt.Errorf("topic %q is not allowed", topic)
	}
	for _, r := range topic {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("topic %q has %q; Kafka allows only ASCII letters, digits, '.', '_' and '-'", topic, r)
		}
	}
	return nil
}

const nilUUID = "00000000-0000-0000-0000-000000000000"

func isUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i, r := range s {
		switch i {
		case 8, 13, 18, 23:
			if r != '-' {
				return false
			}
		default:
			if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f' || r >= 'A' && r <= 'F') {
				return false
			}
		}
	}
	return true
}
