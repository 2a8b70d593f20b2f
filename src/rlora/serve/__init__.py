"""`rlora serve`: a local server of the tinker API (the official `tinker` SDK, 0.38.0, talks to it) that trains
LoRA adapters on one frozen base model (docs/serve.md). An app on top of rlora's components: nothing imports it
but the command line.

  wire.py    the SDK's JSON payloads (pydantic) and the client config that picks the simplest transport
  proto.py   the SDK's protobuf payloads: forward_backward requests, forward_backward and sample results
  state.py   ids, tinker:// paths, saved adapters (PEFT folders) under --state-dir
  losses.py  tinker's built-in losses per token, on rlora's loss functions
  trainstate.py  a training client, its saved adapter and AdamW state checked and restored
  worker.py  the base model and its adapters: training, snapshots, sampling (one thread)
  jobs.py    futures and the worker thread
  limits.py  the API key and the request size, before any route
  app.py     the HTTP routes (FastAPI), sessions
  main.py    argument checks, loading the model, uvicorn
"""
