# CPU image of Strata. `make install` pins torch==2.13.0; on x86_64 PyPI serves the CUDA build of that version,
# so pass --build-arg PIP_EXTRA_INDEX_URL=<a CPU wheel index> to keep the image small on CPU-only hosts.
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 STRATA_CACHE_DIR=/var/cache/strata
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/strata
# Only what the install needs: a checkout's own .venv (whose stamp would skip `make install`), caches and tests
# stay out of the image. The planner's dependencies (statsmodels, kubernetes) come with '.[dev]' (make install).
COPY pyproject.toml Makefile README.md ./
COPY server server
COPY kvbm kvbm
COPY cluster cluster
COPY model_repository model_repository
RUN make install models
EXPOSE 8000 8001 8002 9000
CMD [".venv/bin/strata", "serve", "--model-repository", "/opt/strata/model_repository"]
