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
// Users of their own migration tool can copy the files from FS; each expects
// search_path to name the target schema.
package migrations
