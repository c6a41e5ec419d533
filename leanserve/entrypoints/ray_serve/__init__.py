"""leanserve on Ray Serve (``leanserve serve --replicas N``): engine replicas behind a prefix-cache-aware,
load-aware router. :mod:`.router`, :mod:`.proxy`, :mod:`.fleet` and :mod:`.asgi_bridge` are plain Python;
:mod:`.app` (the Ray Serve deployments) is the only module that imports Ray."""
