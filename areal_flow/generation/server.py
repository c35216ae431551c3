"""`python -m areal_flow.generation.server --model-path DIR --host 127.0.0.1 --port 30000`: the
command line that starts a generation server, kept at this name because launchers, docs and users'
scripts name it. The server itself is the http package's (generation/http/): its command line in
http/cli.py, the HTTP plumbing in http/server.py and http/app.py, the routes in http/routes.py
and http/weight_routes.py."""

import sys

from areal_flow.generation.http.cli import main

if __name__ == "__main__":
    sys.exit(main())
