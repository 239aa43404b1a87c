"""python -m frontend.openai_api [--triton-url localhost:8001] [--port 9000]
[--model-repository model_repository] [--chat-template FILE_OR_TEMPLATE]"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="OpenAI-compatible API in front of tritonserver")
    ap.add_argument("--triton-url", default=os.environ.get("TRITON_GRPC_URL", "localhost:8001"),
                    help="tritonserver's gRPC address")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", "9000")))
    ap.add_argument("--model-repository", help="the repository tritonserver serves (tokenizers, chat templates)")
    ap.add_argument("--chat-template", help="a jinja chat template, or a file holding one (overrides the models')")
    args = ap.parse_args(argv)
    import uvicorn
    from frontend.openai_api.app import create_app
    from frontend.openai_api.chat import load_template
    uvicorn.run(create_app(args.triton_url, args.model_repository, load_template(args.chat_template)),
                host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
