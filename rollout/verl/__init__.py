"""`rollout` as a verl (0.9.x) rollout backend: `actor_rollout_ref.rollout.name=rollout`.

verl imports every `verl.plugins` entry point when it is imported; ours (`rollout.verl.plugin`)
registers the replica (`replica.RolloutReplica`: our engines behind one server actor per replica,
`server.RolloutServer`) and the server adapter (`adapter.ServerAdapter`: verl's weight updates
into our update path). Nothing here is imported unless verl is.
"""
