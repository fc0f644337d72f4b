"""KV-aware request routing over workers (the workers themselves live in `server.workers`).

    config.py    RouterConfig: strategy, fallback, cost weights, busy threshold, lookup budget, staleness
    router.py    Router.route(request_id, block_hashes) -> RouteDecision; prefill_done / release bookkeeping
    cost.py      the cost of a request on a worker (blocks to prefill per tier + load, scaled by speed)
    load.py      WorkerLoad: the router's view of a worker (its last WorkerStats + what was routed there)
    metrics.py   RouterMetrics: decisions by strategy and reason, per-worker load, index staleness
    lookup.py    OverlapLookup: what the router needs from the KVBM index (KVIndex, KVIndexClient)
    staleness.py says loudly when the index stops receiving events while requests flow
    routed.py    RoutedEngine: the Engine Protocol over N workers, routing each request; add_worker
    membership.py   the workers of one model: joining, serving, draining, dying; their routers' view
    speed.py        SpeedMeter (prefill / decode tok/s measured from outputs), speed_class (who shares one)
    state.py        RequestState: a request's states and the transitions allowed between them
    flight.py       Flight (one request's record and state), Flights (the table, timings, release)
    placement.py    place: route, submit, skip a worker that refuses, route again (every placement)
    migration.py    migrate: a dead worker's request resumed on another from its tokens so far
    disagg.py       roles and the conditional rule (where to prefill), with live thresholds
    disagg_flow.py  DisaggFlow: prefill on a prefill worker, hand the KV off, decode on the decode worker

Embedded wiring (one process tree, no Redis):

    index = KVIndex()
    router = Router(RouterConfig(strategy="kv-aware"), index, RouterMetrics.create(registry))
    spec = WorkerSpec(build_llm_engine, (engine_config, kvbm_config), forward_events=True)
    workers = spawn_workers([WorkerId(f"w{i}") for i in range(n)], spec, event_sink=index)
    engine = RoutedEngine(workers, router, workers[0].info.block_size, BlockHash(workers[0].info.salt))
    app = build_app({"smollm2": engine}, FrontendMetrics.create(registry))   # server.openai.app
"""
