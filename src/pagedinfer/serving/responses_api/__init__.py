"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat machinery.

* :mod:`~pagedinfer.serving.responses_api.request`: the request body, checked and translated
  into a chat request (input items to messages, flat tools to chat tools, ``text.format`` to
  ``response_format``).
* :mod:`~pagedinfer.serving.responses_api.output`: a finished answer as a ``response``
  object (reasoning, message and function-call items, usage).
* :mod:`~pagedinfer.serving.responses_api.events`: a streamed answer as the API's
  server-sent events.
* :mod:`~pagedinfer.serving.responses_api.store`: the bounded in-memory store behind
  ``previous_response_id`` and ``GET /v1/responses/{id}``.
"""
