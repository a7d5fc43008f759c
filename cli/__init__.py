"""The command line (`registry`, `main.py`), the Python client it uses (`client.py`) and
`registry watch` (`watch.py`): the outermost layer, which only talks to a registry over HTTP
and WebSocket, except `serve`, which starts one (`service/`)."""
