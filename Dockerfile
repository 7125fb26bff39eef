# One image for both services; compose picks the command. CUDA-capable base so the same
# image runs the inference service on a GPU host.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
WORKDIR /app
ENV PYTHONUNBUFFERED=1
COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY adapter_store ./adapter_store
COPY inference_svc ./inference_svc
COPY kernels ./kernels
RUN pip install --no-cache-dir -c constraints.txt --no-deps . \
 && pip install --no-cache-dir grpcio grpcio-health-checking grpcio-reflection protobuf \
      safetensors tokenizers redis boto3 prometheus-client numpy
EXPOSE 50051 50052 9100
