package idempotency

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
)

// recorder captures a handler's response so it can be stored before the
// client sees it. Up to limit body bytes are kept in memory for storage;
// beyond that the response is marked too large and memory stops growing. In
// stream mode (leased) an oversized response is sent on to the client as it
// comes; otherwise (transactional, where nothing may reach the client before
// the commit) the rest waits in a temporary file until flush.
type recorder struct {
	w      http.ResponseWriter
	header http.Header
	// upstream is w's header when the handler started: what the
	// middlewares around this one set. The handler sees it in header, as
	// it would without this middleware; only what the handler changed is
	// stored (changedHeader), not another request's upstream headers.
	upstream http.Header
	status   int
	body     bytes.Buffer // at most limit bytes
	spill    *os.File     // the body beyond the limit, not in stream mode
	err      error        // the spill failed: the response is lost
	limit    int
	stream   bool
	tooBig   bool
	flushed  bool // headers and buffer already written to w
}

func newRecorder(w http.ResponseWriter, limit int, stream bool) *recorder {
	upstream := w.Header().Clone()
	if upstream == nil {
		upstream = http.Header{}
	}
	return &recorder{w: w, header: upstream.Clone(), upstream: upstream, limit: limit, stream: stream}
}

// changedHeader returns the headers the handler set, added to or changed,
// and, as an empty list, those it deleted (writeResponse deletes them).
func (r *recorder) changedHeader() http.Header {
	out := http.Header{}
	for k, v := range r.header {
		if !slices.Equal(v, r.upstream[k]) {
			out[k] = v
		}
	}
	for k := range r.upstream {
		if _, kept := r.header[k]; !kept {
			out[k] = []string{}
		}
	}
	return out
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(status int) {
	if r.status != 0 || status < 200 {
		return // 1xx informational responses are not stored; repeats are ignored as net/http does
	}
	r.status = status
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	switch {
	case r.flushed:
		return r.w.Write(p)
	case r.err != nil:
		return 0, r.err
	case !r.tooBig && r.body.Len()+len(p) <= r.limit:
		return r.body.Write(p)
	}
	if !r.tooBig {
		r.tooBig = true
		if r.stream {
			r.flush(false)
			return r.w.Write(p)
		}
	}
	if r.spill == nil {
		f, err := os.CreateTemp("", "onceflow-response-*")
		if err != nil {
			r.err = fmt.Errorf("idempotency: hold a response larger than MaxResponseBytes until the commit: %w", err)
			return 0, r.err
		}
		r.spill = f
	}
	n, err := r.spill.Write(p)
	if err != nil {
		r.err = fmt.Errorf("idempotency: hold a response larger than MaxResponseBytes until the commit: %w", err)
	}
	return n, err
}

// close removes the spill file, if any. It is idempotent.
func (r *recorder) close() {
	if r.spill != nil {
		_ = r.spill.Close()
		_ = os.Remove(r.spill.Name())
		r.spill = nil
	}
}

// statusCode is the response status, 200 if the handler wrote nothing.
func (r *recorder) statusCode() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// flush sends the recorded response to the client, once.
func (r *recorder) flush(replayed bool) {
	if r.flushed {
		return
	}
	r.flushed = true
	h := r.w.Header()
	for k := range h {
		if _, kept := r.header[k]; !kept {
			delete(h, k) // the handler deleted an upstream header
		}
	}
	writeResponse(r.w, r.statusCode(), r.header, r.body.Bytes(), replayed)
	if r.spill != nil {
		if _, err := r.spill.Seek(0, io.SeekStart); err == nil {
			_, _ = io.Copy(r.w, r.spill)
		}
		r.close()
	}
}

func writeResponse(w http.ResponseWriter, status int, header map[string][]string, body []byte, replayed bool) {
	h := w.Header()
	for k, v := range header {
		if len(v) == 0 {
			delete(h, k) // the handler deleted it (changedHeader)
			continue
		}
		h[k] = append([]string(nil), v...)
	}
	if replayed {
		h.Set(ReplayedHeader, "true")
	}
	w.WriteHeader(status)
	if len(body) > 0 {
		_, _ = w.Write(body)
	}
}
