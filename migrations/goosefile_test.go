package migrations_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/pgtest"
	"github.com/onceflow/onceflow/migrations"
)

// gooseStatements splits an up file as pressly/goose's SQL parser
// (internal/sqlparser, v3) does: it reads a file only through its
// annotations (a comment line holding "+goose"; an unknown one fails the
// file), refuses a file without `-- +goose Up`, and splits the Up part at
// every line ending in a semicolon unless a `-- +goose StatementBegin` /
// `StatementEnd` pair encloses the statement.
func gooseStatements(sql string) ([]string, error) {
	var stmts []string
	var buf strings.Builder
	up, inBlock := false, false
	for _, line := range strings.Split(sql, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "--") && strings.Contains(line, "+goose") {
			cmd := strings.TrimSpace(strings.Replace(strings.ReplaceAll(line, "--", ""), "+goose", "", 1))
			switch {
			case strings.EqualFold(cmd, "Up") && !up:
				up = true
			case strings.EqualFold(cmd, "StatementBegin") && up && !inBlock:
				inBlock = true
			case strings.EqualFold(cmd, "StatementEnd") && inBlock:
				inBlock = false
				stmts = append(stmts, buf.String())
				buf.Reset()
			default:
				return nil, fmt.Errorf("goose refuses the annotation %q", line)
			}
			continue
		}
		if buf.Len() == 0 && (strings.HasPrefix(trimmed, "--") || line == "") {
			continue
		}
		if !up {
			return nil, fmt.Errorf("must start with '-- +goose Up' annotation: %q comes first", line)
		}
		buf.WriteString(line + "\n")
		if !inBlock {
			code, _, _ := strings.Cut(line, "--")
			if strings.HasSuffix(strings.TrimSpace(code), ";") {
				stmts = append(stmts, buf.String())
				buf.Reset()
			}
		}
	}
	switch {
	case !up:
		return nil, fmt.Errorf("must start with '-- +goose Up' annotation")
	case inBlock:
		return nil, fmt.Errorf("missing '-- +goose StatementEnd' annotation")
	case strings.TrimSpace(buf.String()) != "":
		return nil, fmt.Errorf("unfinished SQL query %q: missing semicolon?", buf.String())
	}
	return stmts, nil
}

// README ("Your own migration tool"): `onceflow migrate print --version N`
// "prints one step (one file per version, as goose or Flyway keep them)";
// docs/operations.md names goose first. The printed files had no
// `-- +goose Up` line, which goose refuses ("failed to parse migration:
// must start with '-- +goose Up' annotation"), and goose would have cut
// version 1's plpgsql function at the semicolons of its body. h97.
func TestPrintedStepIsAGooseMigrationFile(t *testing.T) {
	for _, version := range []int{0, 1, migrations.Latest()} {
		sql, err := migrations.Script("onceflow", version, false)
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?mi)^--\s*\+goose up\s*$`).MatchString(sql) {
			t.Errorf("migrate print --version %d: no `-- +goose Up` line: goose refuses the file (\"must start with '-- +goose Up' annotation\")", version)
		}
		stmts, err := gooseStatements(sql)
		if err != nil {
			t.Errorf("migrate print --version %d: goose would refuse the file: %v", version, err)
		}
		// Each statement goose runs must close every dollar quote it opens.
		dollar := regexp.MustCompile(`\$[A-Za-z_]*\$`)
		for _, stmt := range stmts {
			if n := len(dollar.FindAllString(stmt, -1)); n%2 != 0 {
				t.Errorf("migrate print --version %d: goose would cut this statement at a semicolon inside its dollar-quoted body:\n%s", version, stmt)
			}
		}
	}
}

// Applied as goose applies them (each file's statements in a transaction
// of its own, goose's version row written in it too), the printed steps
// record themselves: Check passes and Up has nothing to do, so `onceflow
// migrate status` and the relay agree with goose.
func TestPrintedStepsAppliedAsGooseDoesAreRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := pgtest.EmptySchema(t)
	conn := pgtest.Conn(t)
	for v := 1; v <= migrations.Latest(); v++ {
		sql, err := migrations.Script(schema, v, false)
		if err != nil {
			t.Fatal(err)
		}
		stmts, err := gooseStatements(sql)
		if err != nil {
			t.Fatalf("version %d: %v", v, err)
		}
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			for _, stmt := range stmts {
				if _, err := tx.Conn().PgConn().Exec(ctx, stmt).ReadAll(); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("version %d as goose runs it: %v", v, err)
		}
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	if applied, err := migrations.Up(ctx, pool, schema); err != nil || len(applied) != 0 {
		t.Fatalf("Up after goose: applied %v, err %v; want nothing to do", applied, err)
	}
}
