"""The systems the bench compares tuichat with, one module each, on the same prompt token ids, greedy, EOS on,
same caps: transformers `generate` one request at a time; a left-padded static batch through `generate`;
transformers' own continuous batching (`generate_batch`), all in tuichat's dtype and device (hf.py); and
llama.cpp's `llama-server` on the same .gguf (its quantized weights), in its own process on loopback (next to
torch, llama.cpp segfaults here; never a dependency): `--llama-server PATH`, else $TUICHAT_LLAMA_SERVER, else
`llama-server` on PATH (llama_server.py). It is started once per run with one parallel slot per tab and the
bench's thread count, and always stopped. Its single stream computes every prompt token (cache_prompt off),
its tabs are concurrent requests on the slots, its multiturn keeps one slot's prompt cache. In `tabs`, the
batching peers get the tabs' arrival times too: the static batch starts when its last prompt has arrived,
`generate_batch`'s manager and llama-server get each prompt when it arrives; `--stagger-ms 0` gives every
system all prompts at once. tuichat itself (tuichat.py) goes through `LocalBackend.stream`, like a front end;
`tuichat_serve` (serve.py) is the same engine behind `tuichat serve` in its own process, the tabs as HTTP
clients: what the HTTP layer costs.
"""
