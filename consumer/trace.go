package consumer

import "context"

// HookTrace wraps the processing of each message, for tracing (pgx's tracer
// style): an adapter such as otelonceflow.Consumer starts a span in
// TraceStart, joined to the producer's trace through the message's headers,
// and ends it in TraceEnd. Like every Hook it is called synchronously on the
// processing path and must be cheap and safe for concurrent use. With no
// HookTrace in Config.Hooks, the Processor does no tracing work at all.
type HookTrace interface {
	// TraceStart is called when the Processor takes a message, before its
	// transaction begins. The context it returns is the one the message is
	// processed under: the handler's and the database's, the dead-letter
	// publish's, and the one given to TraceRetry and TraceEnd. In batch
	// mode TraceStart is called for each message of a batch before the
	// batch's transaction begins, and TraceEnd after it commits, so each
	// message's trace covers the transaction; the BatchHandler and the
	// database calls run under the Processor's context, since the batch's
	// messages belong to many traces. With pipelined commits (the default,
	// Config.PlainBegin unset), the next message's BEGIN and dedup insert
	// go to PostgreSQL in one query with the previous message's COMMIT, so
	// a pgx tracer (otelpgx) shows them under the previous message's
	// context; the handler's own statements and the message's COMMIT are
	// under its own. Set PlainBegin for each message's statements under its
	// own trace, at one more round trip a message.
	TraceStart(ctx context.Context, e TraceStartEvent) context.Context
	// TraceRetry is called after every failed attempt of a traced message
	// that will be retried, with TraceStart's context. A batch retried
	// whole after a conflict gets none: its messages' traces ended,
	// abandoned with the conflict, and the retry traces them again. With
	// several HookTrace hooks, each TraceStart is given the context the
	// previous one returned, the message is processed under the last
	// one's, and each hook's TraceRetry and TraceEnd get the context its
	// own TraceStart returned (TraceEnd in the reverse order, innermost
	// first).
	TraceRetry(ctx context.Context, e RetryEvent)
	// TraceEnd is called once per TraceStart, when the message is finished
	// (committed, duplicate or dead-lettered) or abandoned (shutdown, lost
	// partition, or a failed batch whose messages are then processed one at
	// a time, each traced again: Outcome is zero, Err says why, and the
	// message is processed again).
	TraceEnd(ctx context.Context, e TraceEndEvent)
}

// TraceStartEvent reports a message the Processor takes. Message.ID is not
// set.
type TraceStartEvent struct {
	Consumer string
	Message  Message
}

// TraceEndEvent reports how a traced message left the Processor.
type TraceEndEvent struct {
	Consumer string
	// Message has its ID set, unless it had no usable id.
	Message Message
	// Outcome is zero when the message was abandoned.
	Outcome Outcome
	// Attempts is how many times the handler ran for it.
	Attempts int
	// Retries is how many failed attempts were retried (the TraceRetry
	// calls for it), those that failed before the handler ran or at
	// COMMIT included.
	Retries int
	// BatchSize is the size of the batch transaction that finished it; 1
	// in per-message mode.
	BatchSize int
	// Err is why the message was dead-lettered or abandoned; nil
	// otherwise.
	Err error
	// DeadLetterTopic is where a dead-lettered message went.
	DeadLetterTopic string
}

// traceState collects, under a traced message's context, how it finished.
type traceState struct {
	// hookCtx holds, with more than one trace hook, the context each
	// hook's TraceStart returned, which its TraceRetry and TraceEnd get;
	// with one, that is the message's context itself.
	hookCtx   []context.Context
	msg       Message
	outcome   Outcome
	attempts  int
	retries   int
	batch     int
	cause     error
	deadTopic string
}

type traceKey struct{}

// traced runs fn for msg between the trace hooks' TraceStart and TraceEnd.
// Callers check len(p.hooks.trace) first, so untraced processing allocates
// nothing here.
func (p *Processor) traced(ctx context.Context, msg Message, fn func(context.Context) error) error {
	ctx = p.traceStart(ctx, msg)
	err := fn(ctx)
	p.traceEnd(ctx, err)
	return err
}

// traceStart calls the trace hooks' TraceStart for msg (whose ID is not
// reported) and returns the context to process it under, which carries its
// traceState.
func (p *Processor) traceStart(ctx context.Context, msg Message) context.Context {
	st := &traceState{msg: msg, batch: 1}
	msg.ID = ""
	if len(p.hooks.trace) > 1 {
		st.hookCtx = make([]context.Context, len(p.hooks.trace))
	}
	for i, h := range p.hooks.trace {
		ctx = h.TraceStart(ctx, TraceStartEvent{Consumer: p.name, Message: msg})
		if st.hookCtx != nil {
			st.hookCtx[i] = ctx
		}
	}
	return context.WithValue(ctx, traceKey{}, st)
}

// hookContext is the context hook i of p.hooks.trace gets for the message
// traced under ctx: the one its own TraceStart returned.
func (st *traceState) hookContext(ctx context.Context, i int) context.Context {
	if st == nil || st.hookCtx == nil {
		return ctx
	}
	return st.hookCtx[i]
}

// traceEnd calls the trace hooks' TraceEnd for the message traced under ctx
// (traceStart's), with how it finished; err non-nil means it was abandoned.
func (p *Processor) traceEnd(ctx context.Context, err error) {
	st, _ := ctx.Value(traceKey{}).(*traceState)
	if st == nil {
		return
	}
	ev := TraceEndEvent{Consumer: p.name, Message: st.msg, Outcome: st.outcome, Attempts: st.attempts,
		Retries: st.retries, BatchSize: st.batch, Err: st.cause, DeadLetterTopic: st.deadTopic}
	if err != nil {
		ev.Outcome, ev.Err, ev.DeadLetterTopic = 0, err, ""
	}
	// Innermost first, as the hooks' spans nest.
	for i := len(p.hooks.trace) - 1; i >= 0; i-- {
		p.hooks.trace[i].TraceEnd(st.hookContext(ctx, i), ev)
	}
}

// traceFinished records in a traced message's state how it finished.
func (p *Processor) traceFinished(ctx context.Context, msg Message, o Outcome, attempts, retries, batch int) {
	if st, ok := ctx.Value(traceKey{}).(*traceState); ok {
		st.msg, st.outcome, st.attempts, st.retries, st.batch = msg, o, attempts, retries, batch
	}
}

// traceDeadLetter records in a traced message's state why and where it was
// dead-lettered.
func (p *Processor) traceDeadLetter(ctx context.Context, cause error, topic string) {
	if st, ok := ctx.Value(traceKey{}).(*traceState); ok {
		st.cause, st.deadTopic = cause, topic
	}
}

// traceRetry calls the trace hooks' TraceRetry for the message traced
// under ctx. A batch retried whole after a conflict is retried between its
// messages' traces (each ended, abandoned, with the failed attempt): ctx is
// then the Processor's, and its span none of the hooks' to record on.
func (p *Processor) traceRetry(ctx context.Context, e RetryEvent) {
	st, _ := ctx.Value(traceKey{}).(*traceState)
	if st == nil {
		return
	}
	for i, h := range p.hooks.trace {
		h.TraceRetry(st.hookContext(ctx, i), e)
	}
}
