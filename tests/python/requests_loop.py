"""Fetches a URL again and again through a proxy with one `requests` session (kept-alive
connections, as crawlers use it), printing `<status> <body>` per request as it goes.

usage: requests_loop.py PROXY_URL URL COUNT PAUSE_SECONDS
"""

import sys
import time

import requests


def main() -> int:
    proxy, url, count, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    session = requests.Session()
    session.proxies = {"http": proxy, "https": proxy}
    for _ in range(count):
        try:
            response = session.get(url, timeout=30)
            print(response.status_code, response.text.strip(), flush=True)
        except requests.RequestException as error:
            print("error", type(error).__name__, error, flush=True)
        time.sleep(pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
