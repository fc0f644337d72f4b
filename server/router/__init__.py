"""KV-aware request routing over worker processes.

    config.py    RouterConfig: strategy, fallback, cost weights, busy threshold, lookup budget, staleness
    router.py    Router.route(request_id, block_hashes) -> RouteDecision; prefill_done / release bookkeeping
    cost.py      the cost of a request on a worker (blocks to prefill per tier + load, scaled by speed)
    workers.py   WorkerId, WorkerStats (a worker's report), WorkerLoad (the router's view of it)
    metrics.py   RouterMetrics: decisions by strategy and reason, per-worker load, index staleness
    lookup.py    OverlapLookup: what the router needs from the KVBM index (KVIndex, KVIndexClient)
    staleness.py says loudly when the index stops receiving events while requests flow
    transport.py Channel: ZMQ PUSH/PULL between the server and one worker (ipc, or TCP bound by a remote worker)
    worker.py    the worker process (engine behind the channel), WorkerSpec, WorkerInfo, build_llm_engine
    hardware.py  HardwareInfo and calibrated Speeds a worker reports in its hello
    remote.py    RemoteEngine: the Engine Protocol over a spawned or connected worker; spawn_workers
    routed.py    RoutedEngine: the Engine Protocol over N workers, routing each request; add_worker
    registry.py  remote workers in Redis: Registration (worker side), Directory (server side), key layout
    discovery.py Discovery: adds the remote workers that register for a model to its RoutedEngine
    remote_worker.py  `strata worker`: one engine serving one claimed server at a time

Embedded wiring (one process tree, no Redis):

    index = KVIndex()
    router = Router(RouterConfig(strategy="kv-aware"), index, RouterMetrics.create(registry))
    spec = WorkerSpec(build_llm_engine, (engine_config, kvbm_config), forward_events=True)
    workers = spawn_workers([WorkerId(f"w{i}") for i in range(n)], spec, event_sink=index)
    engine = RoutedEngine(workers, router, workers[0].info.block_size, BlockHash(workers[0].info.salt))
    app = build_app({"smollm2": engine}, FrontendMetrics.create(registry))   # server.openai.app
"""
