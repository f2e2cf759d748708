# Stand-in for `python:3.11-slim` (CI only, no registry reachable): Debian bookworm's Python 3.11
# in a venv on PATH, so `python` and `pip` resolve as in the official image while Debian's
# /usr/bin/python3 stays a separate interpreter (the reward sandbox's `code_python`).
# The build context holds `certs/`: the CA certificates the host added locally; pip uses the
# system bundle that includes them.
FROM local/debian:bookworm
COPY certs/ /usr/local/share/ca-certificates/
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    LANG=C.UTF-8
CMD ["python3"]
