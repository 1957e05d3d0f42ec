"""`edgeinfer serve`: the engine behind an OpenAI-compatible HTTP API (design.md §7).

protocol   request bodies (pydantic) and the limits on their fields
responses  OpenAI's response and chunk shapes, built as plain dicts
sse        server-sent-event framing
errors     OpenAI's error body and the status codes
auth       API keys, compared in constant time
admission  the waiting-queue bound and per-key rate limits
sampling   request fields -> SamplingParams (logit bias, grammars)
grammar    structured output: llguidance masks from a JSON schema
generate   one HTTP request's engine requests (n choices, prompts), merged
metrics    Prometheus metrics under vLLM's names
logs       one log line per request
app        the FastAPI app and its routes
"""
