"""Sockets and processes: the coordinator, the client, the engine worker and the cluster runtime.

Everything that crosses a process boundary lives here; the engine it wraps (`rollout.engine`) is
in-process only. Import from the modules themselves: `serving.coordinator` (the ZMQ ROUTER),
`client` (InferenceClient), `worker` (EngineWorker: one engine behind a DEALER, with `replies`:
its frames and failed records, and `resume`: a request continued from another engine's
checkpoint), `cluster` (EngineCluster: spawn, supervise and tear down a coordinator and N
workers, and push weights to them), `cluster_engine` (the engine protocol over a cluster),
`factory` (model, tokenizer and engine from a source description), `processes`, `supervisor`,
`event_loop`, `auth`, `gc_tuning`.
"""
