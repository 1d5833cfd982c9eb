// Package outbox writes events into onceflow's transactional outbox.
//
// Write the event in the same transaction as the business change it
// describes: the event exists if and only if the transaction commits (G1),
// and the relay (package relay, or `onceflow relay`) publishes it to Kafka at
// least once, in per-key order, with a stable message-id header.
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2)`, id, amount); err != nil {
//			return err
//		}
//		return outbox.Write(ctx, tx, outbox.Message{Topic: "orders", Key: []byte(id), Value: payload})
//	})
//
// Write takes any of pgx.Tx, *pgx.Conn or *pgxpool.Pool and costs one round
// trip however many messages it is given. Writing through a pool or a bare
// connection commits the events on their own and so gives up G1.
//
// Config.Inject adds headers taken from Write's ctx to every event:
// otelonceflow.NewInjector records the W3C trace context there, so the
// consumer's span joins the request's trace.
//
// Producers in other languages write the same rows with plain SQL. key
// and value are bytea: bind bytes, or text through convert_to, since text
// given as it is reads in bytea's escape format (a JSON "\\" would lose a
// backslash); event_id, when set, must not be the nil UUID:
//
//	INSERT INTO onceflow.outbox (topic, key, value, headers)
//	VALUES ('orders', convert_to('k1', 'UTF8'), convert_to('{"id":"o-1"}', 'UTF8'), '{"h":"v"}');
package outbox
