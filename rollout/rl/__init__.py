"""The RL side: `RolloutManager` (samples for a trainer, weight updates, partial rollouts), the
`driver` that steps its engine, exact per-token `staleness`, and the `samples` it hands out."""
