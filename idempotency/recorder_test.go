package idempotency

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
)

func TestTransactionalRecorderStopsBufferingAtTheLimit(t *testing.T) {
	t.Parallel()
	const limit, chunk, total = 1 << 10, 4 << 10, 4 << 20
	w := httptest.NewRecorder()
	rec := newRecorder(w, limit, false)
	defer rec.close()
	rec.Header().Set("Content-Type", "application/octet-stream")
	rec.WriteHeader(http.StatusCreated)
	var want bytes.Buffer
	for i := 0; want.Len() < total; i++ {
		p := bytes.Repeat([]byte{byte('a' + i%26)}, chunk)
		want.Write(p)
		if n, err := rec.Write(p); n != len(p) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
		if rec.body.Cap() > 4*limit {
			t.Fatalf("after %d bytes the recorder holds a %d-byte buffer; want it bounded by the %d-byte limit", want.Len(), rec.body.Cap(), limit)
		}
	}
	if !rec.tooBig {
		t.Fatal("not marked too big")
	}
	if w.Body.Len() != 0 {
		t.Fatalf("%d bytes reached the client before the flush (the commit)", w.Body.Len())
	}
	spill := rec.spill.Name()
	rec.flush(false)
	if _, err := os.Stat(spill); !os.IsNotExist(err) {
		t.Errorf("the overflow file %s is left behind after the flush (%v)", spill, err)
	}
	if w.Code != http.StatusCreated || w.Header().Get("Content-Type") != "application/octet-stream" || !bytes.Equal(w.Body.Bytes(), want.Bytes()) {
		t.Fatalf("client got %d %v and %d bytes, want 201 with all %d bytes", w.Code, w.Header(), w.Body.Len(), want.Len())
	}
}

func TestTransactionalRecorderFailsWritesWhenItCannotHoldTheOverflow(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir()+"/missing") // os.CreateTemp fails
	w := httptest.NewRecorder()
	rec := newRecorder(w, 4, false)
	defer rec.close()
	if _, err := rec.Write([]byte("1234")); err != nil {
		t.Fatalf("within the limit: %v", err)
	}
	if _, err := rec.Write([]byte("5")); err == nil || rec.err == nil {
		t.Fatal("a write past the limit that cannot be held succeeded")
	}
	if _, err := rec.Write([]byte("6")); err == nil {
		t.Fatal("a later write succeeded after the response was lost")
	}
	if w.Body.Len() != 0 {
		t.Fatalf("%d bytes reached the client before the commit", w.Body.Len())
	}
}
