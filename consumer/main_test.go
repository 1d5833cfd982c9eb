package consumer_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/onceflow/onceflow/internal/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, pgtest.LeakIgnores()...)
}
