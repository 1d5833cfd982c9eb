package idempotency

import (
	"bytes"
	"net/http"
)

// recorder captures a handler's response so it can be stored before the
// client sees it. Up to limit body bytes are kept for storage; beyond that
// the response is marked too large. In stream mode (leased) an oversized
// response is sent on to the client as it comes; otherwise (transactional,
// where nothing may reach the client before the commit) it stays buffered.
type recorder struct {
	w       http.ResponseWriter
	header  http.Header
	status  int
	body    bytes.Buffer
	limit   int
	stream  bool
	tooBig  bool
	flushed bool // headers and buffer already written to w
}

func newRecorder(w http.ResponseWriter, limit int, stream bool) *recorder {
	return &recorder{w: w, header: http.Header{}, limit: limit, stream: stream}
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
	if r.flushed {
		return r.w.Write(p)
	}
	if !r.tooBig && r.body.Len()+len(p) > r.limit {
		r.tooBig = true
		if r.stream {
			r.flush(false)
			return r.w.Write(p)
		}
	}
	return r.body.Write(p)
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
	writeResponse(r.w, r.statusCode(), r.header, r.body.Bytes(), replayed)
}

func writeResponse(w http.ResponseWriter, status int, header map[string][]string, body []byte, replayed bool) {
	h := w.Header()
	for k, v := range header {
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
