"""`edgeinfer serve`: the engine behind an OpenAI-compatible HTTP API (design.md §7).

settings     the server's knobs, validated once
protocol     request bodies (pydantic, strict) and the limits on their fields
responses    OpenAI's response and chunk shapes, built as plain dicts
sse          server-sent-event framing and the disconnect watch
errors       OpenAI's error body and the status codes
auth         API keys, compared in constant time
admission    the waiting-queue bound (503) and per-key rate limits (429)
sampling     request fields -> SamplingParams (logit bias, grammars)
grammar      structured output: llguidance masks from a JSON schema
generate     one HTTP request's engine requests (prompts x n choices), merged
metrics      Prometheus metrics under vLLM's names
logs         one log line per request
state        the engine (loaded in the background), admission, requests in flight
completions  the chat and completions handlers, whole and streamed
app          the FastAPI app and its routes
run          uvicorn with a graceful SIGINT/SIGTERM
"""
