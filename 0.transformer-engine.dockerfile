# Step 0: the image every node runs.
#
#   docker build -t transformer-engine -f 0.transformer-engine.dockerfile .
#   docker build -t transformer-engine --build-arg INSTALL_EFA=1 -f 0.transformer-engine.dockerfile .
#   enroot import -o transformer-engine.sqsh dockerd://transformer-engine:latest
#
# Base: NVIDIA's NGC PyTorch 26.06 (Ubuntu 24.04, CUDA 13.3, PyTorch 2.13.0a0 - the same
# minor version as the CPU pin in requirements.txt - with Transformer Engine 2.16 and NCCL
# 2.30 prebuilt). The build stops with a clear message if the image does not hold a
# Transformer Engine 2.x (and warns without flash-attn, which the recipe does not need), so a
# different BASE_IMAGE is checked too.
# The TE releases our code is contract-tested against (this image's and the newest) are
# stated once, in model_utils/precision/te.py (TE_CONTRACT_VERSIONS). The H100 figures were
# measured with the pip wheels TE 2.20.2 and torch 2.11, not with this image (docs/cluster.md,
# "The container path, executed"). tools/container_e2e.sh builds this file, unchanged but
# for BASE_IMAGE, on a CPU stand-in for the NGC image, in `make test`.
#
# The project's pinned requirements are installed WITHOUT touching the image's torch,
# Transformer Engine, flash-attn, triton, numpy or NVIDIA libraries: those are built for
# each other and for this CUDA, and a pip wheel of any of them would silently replace a
# tuned build (or break TE's C++ extension). NGC images pin everything they ship in
# /etc/pip/constraint.txt; we keep only the constraints for those image-owned packages,
# drop them from our requirement list, and check after the install that not one of them
# changed.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

# AWS Elastic Fabric Adapter: libfabric + the aws-ofi-nccl plugin (bundled with the EFA
# installer since 1.39), so NCCL talks EFA between p4d/p5 nodes. Off by default: other
# clusters (InfiniBand, RoCE) use the image's NCCL as is. As in awsome-distributed-training's
# NGC images, the image's own ibverbs packages and HPC-X MPI/UCX are removed first (they
# shadow the installer's rdma-core and libfabric), the plugin's folder goes on the loader path,
# and /etc/nccl.conf names the plugin: recent NGC images ship no aws-ofi-nccl, and NCCL would
# otherwise fall back to TCP sockets without a word. An explicit NCCL_NET_PLUGIN still wins.
ARG INSTALL_EFA=0
ARG EFA_INSTALLER_VERSION=1.48.0
# Fail a RUN when any command of a pipe fails, not only the last one.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# DL3008: curl and ca-certificates come from the base image's Ubuntu snapshot; exact
# Ubuntu versions would break the build at every security update. DL3003: the EFA
# installer must run from its own folder.
# hadolint ignore=DL3003,DL3008
RUN if [ "${INSTALL_EFA}" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends curl ca-certificates \
        && apt-get remove -y --allow-change-held-packages \
            ibverbs-utils libibverbs-dev libibverbs1 libmlx5-1 \
        && rm -rf /opt/hpcx/ompi /opt/hpcx/ucx /usr/local/mpi /usr/local/ucx \
        && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
            | tar -xz -C /tmp \
        && cd /tmp/aws-efa-installer \
        && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
        && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/* \
        && echo /opt/amazon/ofi-nccl/lib > /etc/ld.so.conf.d/aws-ofi-nccl.conf \
        && ldconfig \
        && echo NCCL_NET_PLUGIN=ofi >> /etc/nccl.conf \
        && test -e /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so \
        || { echo "EFA install failed or has no aws-ofi-nccl plugin" >&2; exit 1; }; \
    fi

WORKDIR /workspace/llama-fp8
COPY requirements.txt ./

# Packages the image owns (see the header). Names are matched the way pip normalises them.
ARG IMAGE_OWNED='^(torch|torchvision|torchaudio|triton|pytorch-triton|numpy|apex|transformer[-_]engine[-_a-z0-9]*|flash[-_]attn[-_a-z0-9]*|nvidia-[-_a-z0-9]*)([<>=!~ ;[@]|$)'
RUN grep -iE "${IMAGE_OWNED}" /etc/pip/constraint.txt > /tmp/image-owned.txt || true \
    && grep -viE "${IMAGE_OWNED}" requirements.txt > /tmp/requirements.txt \
    && pip freeze | grep -iE "${IMAGE_OWNED}" > /tmp/before.txt \
    && PIP_CONSTRAINT=/tmp/image-owned.txt pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip freeze | grep -iE "${IMAGE_OWNED}" > /tmp/after.txt \
    && if ! diff /tmp/before.txt /tmp/after.txt; then \
        echo "requirements.txt changed an image-owned package (diff above)" >&2; exit 1; \
    fi \
    && rm -f /tmp/image-owned.txt /tmp/requirements.txt /tmp/before.txt /tmp/after.txt

# --tracker wandb,mlflow (docs/trackers.md): the W&B client and MLflow's client-only package,
# which logs to a tracking server (MLFLOW_TRACKING_URI); the versions of pyproject's [trackers]
# extra, which pins full mlflow for the tests' local store.
# The same guard: an image-owned package must not move.
RUN grep -iE "${IMAGE_OWNED}" /etc/pip/constraint.txt > /tmp/image-owned.txt || true \
    && pip freeze | grep -iE "${IMAGE_OWNED}" > /tmp/before.txt \
    && PIP_CONSTRAINT=/tmp/image-owned.txt pip install --no-cache-dir \
        wandb==0.31.0 mlflow-skinny==3.17.2 \
    && pip freeze | grep -iE "${IMAGE_OWNED}" > /tmp/after.txt \
    && if ! diff /tmp/before.txt /tmp/after.txt; then \
        echo "the trackers changed an image-owned package (diff above)" >&2; exit 1; \
    fi \
    && rm -f /tmp/image-owned.txt /tmp/before.txt /tmp/after.txt

# Checked from package metadata: importing TE needs a GPU driver, which `docker build` lacks.
# (`pip show` fails for a missing package; `|| true` keeps pipefail from ending the build there
# with a bare "exit code: 1" instead of the message below.)
RUN te=$({ pip show transformer_engine 2>/dev/null || true; } | sed -n 's/^Version: //p') \
    && fa=$({ pip show flash_attn 2>/dev/null || true; } | sed -n 's/^Version: //p') \
    && echo "torch $(pip show torch | sed -n 's/^Version: //p'), Transformer Engine ${te:-none}, flash-attn ${fa:-none}" \
    && case "${te}" in \
        2.*) ;; \
        *) echo "this image needs Transformer Engine 2.x: choose another BASE_IMAGE" >&2; exit 1 ;; \
    esac \
    && if [ -z "${fa}" ]; then \
        echo "warning: no flash-attn in this image; TE uses its own fused attention (cuDNN)" >&2; \
    fi

# The recipe itself, so the image can run the smoke test on its own. On the cluster the
# sbatch script runs your checkout from the shared file system instead (mounted, and used
# as --container-workdir), so code edits need no rebuild.
COPY . ./
