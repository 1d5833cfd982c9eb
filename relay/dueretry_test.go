package relay

import (
	"bytes"
	"crypto/sha256"
	"testing"

	"github.com/jackc/pgx/v5"
)

// A blocked key whose backoff has passed is retried with its failed event
// alone (exclusions: the key is held back from the event after it). That
// event must be read whatever the blocked shard's sweep position and
// however many events its other keys hold: a claim that filled the shard's
// read with the other keys' events first left the retry out, the relay
// then dropped the key's hold (forgetLostRetries) and read the stuck key
// from its oldest event like any other key, a whole round of it failing
// and each event charged an attempt.
func TestClaimReadsADueRetryWhateverItsShardsOtherKeysHold(t *testing.T) {
	t.Parallel()
	ctx, st, schema, insert := claimSetup(t)
	pool := st.pool
	stuckShard := sha256.Sum256([]byte("stuck"))[0]
	// A key of the same shard whose hash sorts before the stuck key's:
	// read first from the shard's start.
	var low string
	for _, k := range keysInShard(stuckShard, 50, "stuck") {
		if bytes.Compare(keyHash([]byte(k)), keyHash([]byte("stuck"))) < 0 {
			low = k
			break
		}
	}
	if low == "" {
		t.Fatal("no key below the stuck key's hash in its shard")
	}
	stuckFirst := insert(pool, "stuck")
	insert(pool, "stuck")
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', $1::bytea FROM generate_series(1, 300)`, low); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (topic, key)
SELECT 't', ('other-' || g)::bytea FROM generate_series(1, 3000) g`); err != nil {
		t.Fatal(err)
	}
	due := []keyBlock{{key: []byte("stuck"), firstID: stuckFirst + 1}}
	for _, c := range []struct {
		name   string
		shards []int16
	}{
		{"the stuck key's shard alone", []int16{int16(stuckShard)}},
		{"every shard", everyShard()},
	} {
		// The first claim reads the whole round from the blocked shard;
		// once the rounds are full, it reads a share of it.
		for round := range 3 {
			events, err := st.claim(ctx, "me", c.shards, 100, due, nil)
			if err != nil {
				t.Fatal(err)
			}
			stuck := 0
			for _, e := range events {
				if string(e.key) == "stuck" {
					stuck++
					if e.id != stuckFirst {
						t.Fatalf("%s, claim %d: read the stuck key's event %d past its failed one %d", c.name, round, e.id, stuckFirst)
					}
				}
			}
			if stuck != 1 {
				t.Fatalf("%s, claim %d: %d events: the due retry's failed event %d was not read", c.name, round, len(events), stuckFirst)
			}
		}
	}
}
