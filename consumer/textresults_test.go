package consumer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/consumer"
)

// In exec and simple_protocol mode (PgBouncer in transaction mode) results
// come as text; under a bytea_output or DateStyle pgx cannot read as text
// (which stopped the relay) the Processor reads nothing they change: each
// message's effect commits once, singly and in batches, a redelivery
// skipped.
func TestProcessorUnderTextResultSettings(t *testing.T) {
	for _, set := range []string{`SET bytea_output = 'escape'`, `SET DateStyle = 'German'`} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
			for _, batch := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/batch=%v", set, mode, batch), func(t *testing.T) {
					b := setup(t)
					pool := ownPool(t, func(cfg *pgxpool.Config) {
						cfg.ConnConfig.DefaultQueryExecMode = mode
						cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
							_, err := c.Exec(ctx, set)
							return err
						}
					})
					cfg := &consumer.Config{Schema: b.schema, PlainBegin: mode == pgx.QueryExecModeSimpleProtocol}
					var p *consumer.Processor
					var err error
					if batch {
						p, err = consumer.NewBatch(pool, "c", func(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
							for _, m := range msgs {
								if err := b.record(ctx, tx, "c", m); err != nil {
									return err
								}
							}
							return nil
						}, cfg)
					} else {
						p, err = consumer.New(pool, "c", func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
							return b.record(ctx, tx, "c", m)
						}, cfg)
					}
					if err != nil {
						t.Fatal(err)
					}
					tr := &memTransport{}
					run(t, p, tr, msg(1, "id-1", "k\x00\xff"), msg(2, "id-2", "k"), msg(3, "id-1", "k"))
					for _, id := range []string{"id-1", "id-2"} {
						if got := b.count(t, "message_id = $1", id); got != 1 {
							t.Errorf("effects of %s = %d, want 1", id, got)
						}
					}
				})
			}
		}
	}
}
