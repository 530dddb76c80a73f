# cpufuse's OpenAI-compatible server in a container (docs/deploy.md).
#
#   docker build -t cpufuse .                              # native kernels for every ISA gcc can build here
#   docker build --build-arg ISAS=avx2 -t cpufuse:avx2 .   # only these (comma-separated: amx,avx512,avx2,neon,scalar)
#   docker build --build-arg EXTRAS=ray -t cpufuse:ray .   # with Ray Serve (cpufuse.serve.ray)
#   docker run -p 8080:8080 -v /models:/models cpufuse /models/model.gguf --api-key "$KEY"
#
# At run time cpufuse picks the best ISA the CPU has among those built (numba is the fallback).
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
ARG ISAS=""
ARG EXTRAS=serve
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# the wheel holds the compiled ISAs (setup.py; CPUFUSE_BUILD_ISAS empty = every buildable one)
RUN CPUFUSE_BUILD_ISAS="${ISAS}" pip wheel --no-cache-dir --no-deps -w /wheels . \
    && pip wheel --no-cache-dir -w /wheels "$(ls /wheels/cpufuse-*.whl)[${EXTRAS}]"

FROM python:${PYTHON}-slim
ARG EXTRAS=serve
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "cpufuse[${EXTRAS}]" && rm -rf /wheels \
    && useradd --create-home cpufuse
USER cpufuse
EXPOSE 8080
# 0.0.0.0 inside the container (the port mapping decides who reaches it); pass --api-key in production
ENTRYPOINT ["python", "-m", "cpufuse", "serve", "--host", "0.0.0.0", "--port", "8080"]
