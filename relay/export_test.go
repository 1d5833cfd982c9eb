package relay

// SetLeaseTestHook has r's lease upkeep call hook at its named points:
// "renewed" (a tick has renewed and taken its shards, before it installs
// them), "installed" (after), "release" (releaseExcess is about to send
// its hand-back) and "released" (it was sent). Call it before Run.
func SetLeaseTestHook(r *Relay, hook func(point string)) { r.leases.testHook = hook }
