# Stand-in for `prom/prometheus:v2.53.0` (CI only): Debian bookworm's prometheus 2.42 and wget
# (the compose healthcheck). Like the official image: entrypoint the server, user nobody,
# storage in /prometheus.
FROM local/debian:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
WORKDIR /prometheus
VOLUME /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
