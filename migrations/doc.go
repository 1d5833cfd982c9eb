// Package migrations holds onceflow's SQL schema as numbered up/down files
// and applies them.
//
// Up is idempotent and safe to run from several processes at once (they
// serialize on an advisory lock, in one transaction each); it records applied
// versions in <schema>.schema_migrations. The schema (default "onceflow") is
// quoted as an identifier, never pasted: the files use unqualified names and
// run with search_path set to it.
//
//	applied, err := migrations.Up(ctx, pool, migrations.DefaultSchema)
//
// No wait of Up's for a table's lock lasts longer than DefaultLockTimeout
// (5 s; UpWith and UpConfig.LockTimeout set another): a step waiting for
// the outbox's lock behind an open transaction holds off every producer.
// Past it, Up fails, applying nothing, naming the sessions holding the
// tables; run it again later.
//
// Down refuses to drop tables that hold rows (DownForce drops them) and
// creates nothing in a schema that was never migrated. Check reports the
// migrations a schema lacks; the relay runs it at start.
//
// Users of their own migration tool apply Script's output (`onceflow migrate
// print`): the SQL of each step plus the insert that records its version, so
// Up and Check see it. The bare files in FS record nothing: on a schema
// built from them, Check's error (and Up's refusal) gives the SQL that
// records the versions applied.
package migrations
