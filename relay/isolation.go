package relay

import "errors"

// ErrIsolationSetting is returned by Run at start (wrapped, naming the
// level and the statement that mends it) when the pool's sessions default
// to an isolation level other than READ COMMITTED.
var ErrIsolationSetting = errors.New("relay: the relay's sessions must default to READ COMMITTED")
