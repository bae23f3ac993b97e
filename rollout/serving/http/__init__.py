"""OpenAI-compatible HTTP front end: an ASGI app in front of the coordinator, speaking the
`/v1/completions` and `/v1/chat/completions` wire format, with token ids, log-probs and weight
versions as extension fields so a trainer can use responses without re-tokenizing."""
