"""The HTTP server: the app and its routes (`server.py`), the OpenAI protocol (`protocol.py`), bounded input work
(`limits.py`, `transport.py`), structured outputs and tool calls (`structured.py`, `grammars.py`, `tool_calls.py`,
`tool_syntax.py`), metrics, OpenAPI and auth."""
