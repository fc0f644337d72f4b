"""vLLM as an engine behind Strata's workers, router and KV index (`backend: "vllm"`).

    config.py     a Triton vLLM-backend model.json (vLLM's engine arguments) read on the server's side, no vLLM
    engine.py     `VLLMEngine`: the Engine protocol over vLLM's AsyncLLM, in a worker process of the vLLM venv
    kv_events.py  vLLM's KV cache events (ZMQ) re-keyed with Strata's block hashes, as KVBM tier events

vLLM needs numpy 2 and PyTriton numpy 1, so vLLM runs only in worker processes started with another Python
(`--vllm-python`, `make vllm`); the server's process imports config.py alone (an import rule in pyproject.toml).
"""
