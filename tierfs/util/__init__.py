"""General helpers every layer uses: argument checks, retries, background workers, durable local files, exit handling."""
