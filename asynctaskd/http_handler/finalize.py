"""finalize: result files copied to `dir` or a `put` target before SUCCEEDED, downloaded only
from declared hosts and public addresses (`asynctaskd.downloads`)."""

from __future__ import annotations

import mimetypes
import re
from collections.abc import AsyncIterator
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import anyio
import httpx
import msgspec

from asynctaskd.downloads import DownloadFailed, DownloadRefused, Downloads, origin_of
from asynctaskd.errors import PermanentError, RetryableError
from asynctaskd.handlers import HandlerContext

from .credentials import _Redacting, _SecretMissing
from .options import FinalizeOptions, HttpOptions
from .plan import _Plan
from .templates import _MISSING, _Missing, _Rendering, _ValueMissing, _ValueRefused, _Vars

_FINALIZE_DEPTH: Final = 8  # objects and lists below a finalize pointer, searched this deep


_FINALIZE_FILES: Final = 100  # files one result may hold


def _origin(url: str) -> tuple[str, str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return ("", "")
    return (parts.scheme.lower(), parts.netloc.lower())


class _Finalizing(_Redacting, _Rendering):
    """HttpHandler's finalize() and the copies it makes."""

    plan: _Plan
    options: HttpOptions
    _timeout: httpx.Timeout
    _base_origin: tuple[str, str, int | None] | None
    _download_home: tuple[str, str, int | None] | _Missing | None

    if TYPE_CHECKING:  # HttpHandler's

        def _client(self, ctx: HandlerContext) -> httpx.AsyncClient: ...

        def _base(self) -> str: ...

    async def finalize(self, result: Any, ctx: HandlerContext) -> Any:
        """Copy result files to `dir` or a `put` target; the result then points at the copies.

        Each `files` pointer names a value or a list of values. Without `download`, only
        http(s) URLs are copied (other values, such as text output, are left alone); with
        it, every value is turned into a URL first (e.g. a file id). In objects below the
        pointer (a model's output may be {"image": url, "mask": url}) every http(s) URL is
        copied, up to 8 levels deep and 100 files a result.

        The vendor chooses these URLs, so they are fetched only from `hosts` (and the host
        the `download` template names), never from a private, loopback or link-local
        address unless `allow_private_addresses` (`asynctaskd.downloads` says how, DNS
        included), and without the vendor's credentials unless the `download` template
        made the URL on `base_url`'s origin. A URL refused so fails the task for good
        (PermanentError, FINALIZE_REFUSED; an unsafe `{value}`, UNSAFE_VALUE): nothing is
        sent. Any other failure raises RetryableError: the task stays RUNNING and the
        worker retries.
        """
        options = self.plan.options.finalize
        if options is None:
            return result
        result = msgspec.json.decode(msgspec.json.encode(result))  # a private copy
        t = self.options.timeouts
        downloads = Downloads(
            self.plan.finalize_hosts,
            allow_private=options.allow_private_addresses,
            connect=float(t.connect),
            read=float(t.read),
        )
        count = [0]

        async def copy(value: Any, depth: int, in_object: bool) -> Any:
            """`value` with its files copied: a value or a list of values at the pointer
            (ids too, with a download template), and URLs anywhere in objects below it
            (a model's output may be {"image": url, "mask": url}), up to a bound."""
            if isinstance(value, dict | list):
                if depth >= _FINALIZE_DEPTH:
                    return value
                pairs = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in list(pairs):
                    inner = in_object or isinstance(value, dict)
                    value[key] = await copy(item, depth + 1, inner)
                return value
            if isinstance(value, bool) or not isinstance(value, str | int):
                return value
            is_url = isinstance(value, str) and _origin(value)[0] in ("http", "https")
            if not is_url and (in_object or self.plan.finalize_download is None):
                return value
            if count[0] >= _FINALIZE_FILES:
                raise PermanentError(
                    f"finalize: the result holds more than {_FINALIZE_FILES} files",
                    code="FINALIZE_REFUSED",
                )
            count[0] += 1
            return await self._copy_with_retries(str(value), count[0] - 1, options, ctx, downloads)

        async with downloads:
            for pointer in self.plan.finalize_files:
                found = pointer.get(result)
                if found is _MISSING or found is None:
                    continue
                result = pointer.set(result, await copy(found, 0, False))
        return result

    def _download_origin(self) -> tuple[str, str, int | None] | None:
        """The origin every URL the `download` template makes has, or None when a value
        lands in its scheme or authority (then its host must be in `finalize.hosts`)."""
        if isinstance(self._download_home, _Missing):
            template = self.plan.finalize_download
            assert template is not None
            fixed: list[str] = []
            for part in template.parts:
                if isinstance(part, str):
                    fixed.append(part)
                elif part.kind == "base_url":
                    fixed.append(self._base())
                else:
                    break
            text = "".join(fixed)
            whole = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*[/?#]", text)
            self._download_home = origin_of(text) if whole else None
        return self._download_home

    async def _copy_with_retries(
        self,
        value: str,
        n: int,
        options: FinalizeOptions,
        ctx: HandlerContext,
        downloads: Downloads,
    ) -> str:
        last = ""
        for attempt in range(options.attempts):
            if attempt:
                await anyio.sleep(min(5.0, 0.2 * 2 ** (attempt - 1)))
            try:
                return await self._copy(value, n, options, ctx, downloads)
            except DownloadRefused as exc:
                # Every attempt would be refused the same way: fail the task, say why.
                why = self._secrets.redact(str(exc))
                raise PermanentError(
                    f"finalize: result file {n}: {why}; nothing was sent",
                    code="FINALIZE_REFUSED",
                ) from None
            except (
                httpx.HTTPError,  # the PUT
                httpx.InvalidURL,
                ValueError,
                OSError,
                DownloadFailed,
                _CopyError,
                _SecretMissing,
            ) as exc:
                last = self._explain(exc)
                ctx.logger.warning(
                    "finalize: copy %d failed (attempt %d of %d): %s",
                    n,
                    attempt + 1,
                    options.attempts,
                    last,
                )
        raise RetryableError(
            f"finalize: copying result file {n} failed {options.attempts} times; last: {last}",
            code="FINALIZE_FAILED",
        )

    async def _copy(
        self,
        value: str,
        n: int,
        options: FinalizeOptions,
        ctx: HandlerContext,
        downloads: Downloads,
    ) -> str:
        plan = self.plan
        v = _Vars(ctx.task_id, ctx.idempotency_key, base_url=self._base(), value=value)
        home = None
        try:
            if plan.finalize_download is not None:
                source = self._render_text(plan.finalize_download, v, url=True)
                home = self._download_origin()
            else:
                source = value
        except _ValueMissing as exc:
            raise _CopyError(f"{exc.ref.text} has no value") from None
        except _ValueRefused as exc:
            raise PermanentError(
                f"finalize: {exc}; nothing was sent", code="UNSAFE_VALUE"
            ) from None
        url = downloads.check(source, also=None if home is None else home[1])
        headers: dict[str, str] = {}
        if home is not None and home == self._base_origin and origin_of(str(url)) == home:
            # Vendor credentials go only with a URL our own template made on the vendor's
            # origin: never to another host, nor to a path a vendor's answer chose.
            headers = self._render_headers(plan.base_headers, v)
        client = self._client(ctx)
        with anyio.fail_after(float(options.timeout)):
            async with downloads.get(url, headers) as response:
                if not 200 <= response.status < 300:
                    raise _CopyError(f"download answered {response.status}")
                length = response.headers.get("content-length")
                if length and length.isdigit() and int(length) > options.max_bytes:
                    raise _CopyError(f"file is {length} bytes, over finalize.max_bytes")
                content_type = response.headers.get("content-type", "")
                v.name = f"{ctx.task_id}-{n}{_extension(source, content_type)}"
                if options.dir is not None:
                    return await self._write_file(response.chunks(), options, v.name)
                data = bytearray()
                async for chunk in response.chunks():
                    data += chunk
                    if len(data) > options.max_bytes:
                        raise _CopyError("file is over finalize.max_bytes")
            assert plan.finalize_put is not None  # checked when built: dir or put
            target = self._render_text(plan.finalize_put, v, url=True)
            put_headers = self._render_headers(plan.finalize_headers, v)
            if content_type:
                put_headers.setdefault("Content-Type", content_type)
            answer = await client.put(
                target, content=bytes(data), headers=put_headers, timeout=self._timeout
            )
            if not 200 <= answer.status_code < 300:
                raise _CopyError(
                    f"PUT answered {answer.status_code}: {self._excerpt(answer.content)}"
                )
            return target

    async def _write_file(
        self, chunks: AsyncIterator[bytes], options: FinalizeOptions, name: str
    ) -> str:
        assert options.dir is not None
        directory = anyio.Path(options.dir)
        await directory.mkdir(parents=True, exist_ok=True)
        final = directory / name
        partial = directory / f".{name}.partial"
        size = 0
        async with await anyio.open_file(partial, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > options.max_bytes:
                    raise _CopyError("file is over finalize.max_bytes")
                await out.write(chunk)
        await partial.rename(final)  # atomic: a reader never sees half a file
        return str(final)


class _CopyError(Exception):
    pass


def _extension(url: str, content_type: str) -> str:
    suffix = PurePosixPath(urlsplit(url).path).suffix
    if re.fullmatch(r"\.[A-Za-z0-9]{1,8}", suffix):
        return suffix.lower()
    guessed = (
        mimetypes.guess_extension(content_type.split(";")[0].strip()) if content_type else None
    )
    return guessed or ".bin"
