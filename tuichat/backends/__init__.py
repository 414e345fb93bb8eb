"""Where a front end's request goes: the Backend protocol every front end speaks (protocol), the router that
sends each model to its backend (router), the local engine's backend (local), and remote OpenAI-compatible
endpoints (endpoints: their config; remote: the HTTP client). Importing this package imports none of them: the
TUI paints before torch or httpx could have loaded."""
