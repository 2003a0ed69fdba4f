"""A bare HTTP/1 forward relay in asyncio (bench/proxy.py's floor): reads the request line,
connects to the absolute URL's host and pipes bytes both ways, nothing else. What any asyncio
proxy costs on this machine before it does any work. `python bench/bare_relay.py [uvloop]`
prints its port."""

from __future__ import annotations

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
    head = await creader.readuntil(b"\r\n\r\n")
    line, rest = head.split(b"\r\n", 1)
    method, url, version = line.split(b" ")
    authority, _, path = url.split(b"//", 1)[1].partition(b"/")
    host, port = authority.decode().rsplit(":", 1)
    ureader, uwriter = await asyncio.open_connection(host, int(port))
    uwriter.write(b"%s /%s %s\r\n%s" % (method, path, version, rest))
    await asyncio.gather(pipe(creader, uwriter), pipe(ureader, cwriter))


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["uvloop"]:
        import uvloop

        uvloop.install()
    asyncio.run(main())
