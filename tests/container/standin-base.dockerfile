# A stand-in for NVIDIA's NGC PyTorch image, for machines that cannot pull it (the tests'):
# tools/container_e2e.sh builds 0.transformer-engine.dockerfile on it, unchanged except its
# BASE_IMAGE, so that the recipe's own RUN steps, pins and checks really run. What NGC images
# have and the recipe relies on, this has too, in the same places:
#   - one system Python (here Debian 12's 3.11) whose `python` and `pip` are on the image's PATH,
#     packages in /usr/local/lib/python3.X/dist-packages, pip allowed to install there;
#   - torch (here the pinned CPU wheel of requirements.txt) and numpy, owned by the image;
#   - a `transformer_engine` distribution (here the project's TE test double, tests/te_double,
#     at the release the NGC image ships, marked `+double`);
#   - /etc/pip/constraint.txt pinning every package the image ships, named by PIP_CONSTRAINT.
# What it lacks: CUDA, cuDNN, NCCL, flash-attn, a real Transformer Engine (docs/cluster.md).
#
# Build context (made by tools/container_e2e.sh): ca-certificates.crt (the host's bundle:
# PyPI may be reached through a TLS-intercepting proxy), wheels/ (the torch wheel), te_double/.
ARG DEBIAN_IMAGE=llama-fp8-debian:bookworm
FROM ${DEBIAN_IMAGE}

ARG TE_VERSION=2.16.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY wheels/ /tmp/wheels/
COPY te_double/ /tmp/te_double/

# DL3013: the torch wheel is a local file, numpy is pinned; the rest are torch's own
# dependencies at the versions pip resolves for it, as in any image.
# hadolint ignore=DL3013
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && pip install --no-cache-dir --root-user-action=ignore /tmp/wheels/torch-*.whl numpy==2.4.6 \
    && site=$(pip show torch | sed -n 's/^Location: //p') \
    && cp -r /tmp/te_double/transformer_engine /tmp/te_double/te_double "${site}/" \
    && dist="${site}/transformer_engine-${TE_VERSION}+double.dist-info" \
    && mkdir "${dist}" \
    && printf 'Metadata-Version: 2.1\nName: transformer_engine\nVersion: %s+double\nSummary: %s\n' \
        "${TE_VERSION}" "TEST DOUBLE of Transformer Engine (pure PyTorch), tests/te_double" \
        > "${dist}/METADATA" \
    && echo pip > "${dist}/INSTALLER" \
    && find "${site}/transformer_engine" "${site}/te_double" "${dist}" -type f \
        | sed "s|^${site}/||; s|\$|,,|" > "${dist}/RECORD" \
    && mkdir -p /etc/pip \
    && pip list --format=freeze > /etc/pip/constraint.txt \
    && rm -rf /tmp/wheels /tmp/te_double

# The double reports this release too (its __version__), as the distribution does.
ENV TE_DOUBLE_VERSION=${TE_VERSION} \
    PIP_CONSTRAINT=/etc/pip/constraint.txt
# NGC images start a shell by default; `enroot import dockerd://` needs a command to create the
# container it exports.
CMD ["/bin/bash"]
