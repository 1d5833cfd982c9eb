package relay

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/onceflow/onceflow/migrations"
)

// NumShards is the number of ordering shards; fixed by the schema.
const NumShards = 256

// Config configures a Relay. A nil *Config means all defaults.
type Config struct {
	// Schema holds onceflow's tables. Defaults to "onceflow".
	Schema string
	// InstanceID names this relay in relay_instances and shard leases; it
	// must be unique among live relays. A row of the same id that has not
	// lapsed is waited for: Run refuses to start, with an
	// *InstanceInUseError, as soon as it sees the holder's heartbeat
	// advance (a live relay), and takes the row once it lapses (a killed
	// predecessor's, which nobody renews).
	// Defaults to host-pid-random.
	InstanceID string
	// BatchSize is the most events read and published per round.
	// Defaults to 1000.
	BatchSize int
	// BatchBytes bounds a round by size as well: the most bytes of keys,
	// values and headers read and published per round. An event larger
	// than BatchBytes is published alone. A relay holds about two rounds
	// (the read-ahead), so this bounds its memory for events. Defaults to
	// 16 MiB.
	BatchBytes int
	// ProbeInterval is how often an idle relay probes for new events: one
	// read of the outbox's id sequence (no trigger or NOTIFY on the write
	// path, so writers pay nothing). When the probe sees new ids, or after
	// a round that found events, the relay reads its shards at once, and it
	// keeps reading every ProbeInterval for 20 intervals after new ids
	// appear, since the transactions that took them may commit a little
	// later; the newest id committing later still wakes it too. Defaults
	// to 5ms.
	ProbeInterval time.Duration
	// PollInterval is how often an idle relay reads its shards whatever the
	// probe says: the backstop for an event whose transaction committed
	// long after it was inserted, behind a newer event (the probe watches
	// the newest id only). Defaults to 250ms.
	PollInterval time.Duration
	// LeaseDuration is how long a shard lease lasts without renewal; leases
	// are renewed every third of it. A killed relay's shards are taken over
	// within about LeaseDuration plus a third. Defaults to 6s.
	LeaseDuration time.Duration
	// UnknownTopicGrace is how long an event's topic may stay unknown
	// (answers "unknown topic" without a break: any other answer starts
	// the count again) before the event is dead-lettered. Defaults to 1m.
	UnknownTopicGrace time.Duration
	// PublishTimeout bounds how long a round waits for Kafka's
	// acknowledgements. A record not acknowledged by then (a partition that
	// cannot take writes, e.g. below min.insync.replicas) is a failed,
	// passing attempt for its key only: the key's later events are held
	// back, it is retried beside the rounds with backoff and never
	// dead-lettered for it, and every other key goes on. If the publisher
	// can tell a key's partition (PartitionReporter, as both publishers of
	// this module do), the relay marks that partition sick: later rounds
	// hold back, without sending them, the events of every key of it, and
	// one probe at a time retries the partition beside the rounds until it
	// acknowledges, which clears the mark and lets its keys go on. Defaults
	// to 30s.
	PublishTimeout time.Duration
	// TopicForbiddenGrace is how long an event's topic may keep answering
	// "not authorized" (without a break) before the event is dead-lettered:
	// an ACL being granted or an authorizer restart is routine.
	// Defaults to 1m.
	TopicForbiddenGrace time.Duration
	// KafkaHandoff is how long a relay that reaches PostgreSQL but no Kafka
	// broker (its Publisher's Ping fails: a network policy on its node, a
	// secret rotated under it) keeps its shards while another live relay
	// reaches Kafka; then it hands them over, and takes its share back once
	// it reaches Kafka again. While no relay reaches Kafka (the brokers are
	// down) every relay keeps its share. A Publisher without a Ping method
	// counts as reaching Kafka; a relay counts as not reaching it until a
	// broker first answered. Must be at least LeaseDuration (the brokers
	// are pinged once a lease tick, each ping given up to KafkaHandoff).
	// Defaults to 1m (LeaseDuration if that is longer).
	KafkaHandoff time.Duration
	// MaxRetryBackoff caps the wait before a key whose event failed is tried
	// again, before jitter: each wait is drawn ±50% around the exponential
	// backoff's interval, so at the cap a key waits 5-15 s by default.
	// Defaults to 10s.
	MaxRetryBackoff time.Duration
	// MaxHeldKeys caps how many keys the relay holds back at once (keys
	// whose event failed, timed out or waits on a sick partition), since
	// each is left out of every read by name and a read's cost grows with
	// them. When a key would go past the cap, the relay instead reads no
	// event of that key's partition at or above its failed one (other than
	// the held keys' own retries) until the held keys are down to half;
	// other partitions go on (the reads leave out by id, and read on past,
	// up to 4,096 such events; other partitions' events past those wait
	// too). In a broker outage over many keys the relay stops reading new
	// work rather than remembering every key it saw fail, and drains at
	// once when the outage ends. Defaults to 1024.
	MaxHeldKeys int
	// Logger receives Warn and Error logs, Info for start, stop, shards
	// taken and handed back and recovery after an outage, and Debug for the
	// loop's decisions (leases, each round's outcome, wake-ups). Lines carry
	// instance=InstanceID; errors are logged as error. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Observer receives metrics events. Defaults to none.
	Observer Observer
}

func (c *Config) withDefaults() (Config, error) {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.Schema == "" {
		out.Schema = migrations.DefaultSchema
	}
	if err := migrations.ValidateSchema(out.Schema); err != nil {
		return out, fmt.Errorf("relay: Config.Schema: %w", err)
	}
	if out.InstanceID == "" {
		out.InstanceID = DefaultInstanceID()
	}
	if out.BatchSize == 0 {
		out.BatchSize = 1000
	}
	if out.BatchSize < 1 || out.BatchSize > 100_000 {
		return out, fmt.Errorf("relay: Config.BatchSize must be between 1 and 100000, got %d", out.BatchSize)
	}
	if out.BatchBytes == 0 {
		out.BatchBytes = 16 << 20
	}
	if out.BatchBytes < 1 {
		return out, fmt.Errorf("relay: Config.BatchBytes must be positive, got %d", out.BatchBytes)
	}
	if out.ProbeInterval == 0 {
		out.ProbeInterval = 5 * time.Millisecond
	}
	if out.ProbeInterval < 100*time.Microsecond {
		return out, fmt.Errorf("relay: Config.ProbeInterval must be at least 100µs, got %s", out.ProbeInterval)
	}
	if out.PollInterval == 0 {
		out.PollInterval = 250 * time.Millisecond
	}
	if out.PollInterval < time.Millisecond {
		return out, fmt.Errorf("relay: Config.PollInterval must be at least 1ms, got %s", out.PollInterval)
	}
	if out.LeaseDuration == 0 {
		out.LeaseDuration = 6 * time.Second
	}
	if out.LeaseDuration < 300*time.Millisecond {
		return out, fmt.Errorf("relay: Config.LeaseDuration must be at least 300ms, got %s", out.LeaseDuration)
	}
	if out.UnknownTopicGrace == 0 {
		out.UnknownTopicGrace = time.Minute
	}
	if out.UnknownTopicGrace < 0 {
		return out, fmt.Errorf("relay: Config.UnknownTopicGrace must not be negative, got %s", out.UnknownTopicGrace)
	}
	if out.TopicForbiddenGrace == 0 {
		out.TopicForbiddenGrace = time.Minute
	}
	if out.TopicForbiddenGrace < 0 {
		return out, fmt.Errorf("relay: Config.TopicForbiddenGrace must not be negative, got %s", out.TopicForbiddenGrace)
	}
	if out.KafkaHandoff == 0 {
		out.KafkaHandoff = max(time.Minute, out.LeaseDuration)
	}
	if out.KafkaHandoff < out.LeaseDuration {
		// The brokers are pinged once a lease tick: a shorter handoff
		// would be decided by where the tick falls, not by Kafka.
		return out, fmt.Errorf("relay: Config.KafkaHandoff must be at least Config.LeaseDuration (%s), got %s", out.LeaseDuration, out.KafkaHandoff)
	}
	if out.PublishTimeout == 0 {
		out.PublishTimeout = 30 * time.Second
	}
	if out.PublishTimeout < 10*time.Millisecond {
		return out, fmt.Errorf("relay: Config.PublishTimeout must be at least 10ms, got %s", out.PublishTimeout)
	}
	if out.MaxRetryBackoff == 0 {
		out.MaxRetryBackoff = 10 * time.Second
	}
	if out.MaxRetryBackoff < 0 {
		return out, fmt.Errorf("relay: Config.MaxRetryBackoff must not be negative, got %s", out.MaxRetryBackoff)
	}
	if out.MaxHeldKeys == 0 {
		out.MaxHeldKeys = 1024
	}
	if out.MaxHeldKeys < 0 {
		return out, fmt.Errorf("relay: Config.MaxHeldKeys must not be negative, got %d", out.MaxHeldKeys)
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Observer == nil {
		out.Observer = nopObserver{}
	}
	return out, nil
}

// DefaultInstanceID returns a new instance id of the form Config.InstanceID
// defaults to: host-pid-random (six hex digits), unique among live relays.
func DefaultInstanceID() string {
	host, _ := os.Hostname()
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b))
}
