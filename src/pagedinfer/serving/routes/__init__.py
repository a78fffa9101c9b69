"""The app's routes, one module per concern: ``info`` (``/health``, ``/metrics``,
``/version``, ``/v1/models``), ``tokens`` (``/tokenize``, ``/detokenize``), ``completions``,
``chat``, ``responses`` (``/v1/responses``), ``messages`` (Anthropic's ``/v1/messages``)
and ``invocations`` (SageMaker's ``/invocations``). Each route is a module-level handler
that takes the app's :class:`~pagedinfer.serving.state.ServingState` as a dependency
(``state: State``); ``build_app`` maps the paths to them."""
