package migrations_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/migrations"
)

// README ("Your own migration tool"): `onceflow migrate print --version N`
// "prints one step (one file per version, as goose or Flyway keep them)",
// to be applied "as `migrate up` does (goose, Flyway and Atlas wrap each
// file by default ...)"; docs/operations.md names goose first. goose reads a
// .sql file only through its annotations: a file without a
// `-- +goose Up` line is refused ("failed to parse migration: must start
// with '-- +goose Up' annotation"), and it splits the Up part at every line
// that ends in a semicolon unless a `-- +goose StatementBegin` /
// `StatementEnd` pair encloses the statement, so a dollar-quoted function
// body is cut in the middle. The printed step has neither, and no doc says
// to add them. h97.
func TestPrintedStepIsAGooseMigrationFile(t *testing.T) {
	for _, version := range []int{1, migrations.Latest()} {
		sql, err := migrations.Script("onceflow", version, false)
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?mi)^--\s*\+goose up\s*$`).MatchString(sql) {
			t.Errorf("migrate print --version %d: no `-- +goose Up` line: goose refuses the file (\"must start with '-- +goose Up' annotation\")", version)
		}
		// goose's split: a statement ends at a line whose last word ends
		// in ';', unless StatementBegin/End enclose it. Each piece must
		// close every dollar quote it opens.
		dollar := regexp.MustCompile(`\$[A-Za-z_]*\$`)
		var stmt strings.Builder
		inBlock := false
		for _, line := range strings.Split(sql, "\n") {
			switch strings.ToLower(strings.TrimSpace(line)) {
			case "-- +goose statementbegin":
				inBlock = true
				continue
			case "-- +goose statementend":
				inBlock = false
				stmt.Reset()
				continue
			}
			code, _, _ := strings.Cut(line, "--")
			stmt.WriteString(code + "\n")
			if !inBlock && strings.HasSuffix(strings.TrimSpace(code), ";") {
				if n := len(dollar.FindAllString(stmt.String(), -1)); n%2 != 0 {
					t.Errorf("migrate print --version %d: goose would cut this statement at a semicolon inside its dollar-quoted body:\n%s", version, stmt.String())
				}
				stmt.Reset()
			}
		}
	}
}
