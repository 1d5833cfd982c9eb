package idempotency_test

import (
	"bufio"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/proctest"
)

// helper 98: a request whose body the client does not finish (it announced
// 100 bytes and sent 10, or sent a malformed chunk) cannot be fingerprinted.
// That is the request's fault, like the 413 for a body too large, but the
// middleware answers it 500 "internal server error" and logs it as a
// server failure ("idempotency: request failed") at Warn: a client that
// drops its uploads raises the service's error rate and its alerts.
func TestTruncatedRequestBodyIsNotAServerError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &proctest.Buffer{}
	srv := newServer(t, b, idempotency.Config{Logger: slog.New(slog.NewTextHandler(logs, nil))},
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	for _, tc := range []struct{ name, raw string }{
		{"short body", "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\nX-User: alice\r\nContent-Length: 100\r\n\r\n0123456789"},
		{"malformed chunk", "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k2\r\nX-User: alice\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n0123\r\n"},
	} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = conn.Write([]byte(tc.raw))
		_ = conn.(*net.TCPConn).CloseWrite() // the client is done sending; it still reads the answer
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		resp.Body.Close()
		conn.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: answered %d for the client's incomplete body, want 400; logged:\n%s", tc.name, resp.StatusCode, logs.String())
		}
	}
	if strings.Contains(logs.String(), "request failed") {
		t.Errorf("the clients' incomplete bodies were logged as server failures:\n%s", logs.String())
	}
}
