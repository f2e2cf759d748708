# Stand-in for `redis:7` (CI only): Debian bookworm's redis-server 7.0. Like the official image:
# protected mode off (the official build flips its default; only the compose network reaches
# it), working directory /data (AOF lands on the volume), runs as the `redis` user.
FROM local/debian:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data \
 && printf '#!/bin/sh\nif [ "$1" = redis-server ]; then shift; exec redis-server "$@" --protected-mode no; fi\nexec "$@"\n' \
      > /usr/local/bin/docker-entrypoint.sh \
 && chmod 755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
USER redis
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
