"""Anthropic's Messages API (``POST /v1/messages``) on top of the chat machinery, as vLLM and
llama.cpp's server serve it.

* :mod:`~pagedinfer.serving.anthropic_api.request`: the request body, checked and translated
  into a chat request (content blocks to messages, tools, ``tool_choice``).
* :mod:`~pagedinfer.serving.anthropic_api.output`: a finished answer as a ``message``, and a
  streamed one as the API's events.
"""
