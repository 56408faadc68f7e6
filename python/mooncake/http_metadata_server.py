"""``python -m mooncake.http_metadata_server``: as the mooncake_http_metadata_server script."""

from .cli import http_metadata_server_main as main

if __name__ == "__main__":
    main()
