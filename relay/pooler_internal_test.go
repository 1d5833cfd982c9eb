package relay

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Statement losses stop the relay at the third within a minute; other
// errors, and losses spread wider apart, do not.
func TestStatementLossStopsAtTheThirdWithinAMinute(t *testing.T) {
	missing := &pgconn.PgError{Code: "26000", Message: `prepared statement "stmtcache_1" does not exist`}
	there := &pgconn.PgError{Code: "42P05", Message: `prepared statement "stmtcache_1" already exists`}
	other := &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	t0 := time.Now()

	var spread statementLoss
	for i, err := range []error{missing, there, other, missing} {
		if stop := spread.note(err, t0.Add(time.Duration(i)*40*time.Second)); stop != nil {
			t.Fatalf("loss %d (40 s apart) stopped the relay: %v", i, stop)
		}
	}

	var close statementLoss
	for i, err := range []error{missing, other, errors.New("dial tcp: connection refused"), there} {
		if stop := close.note(err, t0.Add(time.Duration(i)*time.Second)); stop != nil {
			t.Fatalf("error %d stopped the relay: %v", i, stop)
		}
	}
	stop := close.note(missing, t0.Add(10*time.Second))
	if !errors.Is(stop, ErrPreparedStatementsLost) || !errors.Is(stop, missing) {
		t.Fatalf("the third loss within a minute returned %v, want ErrPreparedStatementsLost wrapping the last loss", stop)
	}
}
