"""Row reads and writes of the stage path without the query compiler (issue 7: worker CPU).

A trivial stage spends most of its worker CPU building and compiling ORM querysets, not in the
database: an ORM ``filter(pk=...)`` read costs about 13 times a raw ``SELECT`` of the same row.
The statements every stage runs - lock the run, lease and settle its job, update its stage
record, upsert its output blob, insert the next group's records and jobs, append its events,
read the stage records and outputs - are therefore written here as SQL built once per *shape*
(model, columns, filter) and cached, and run through a Django cursor (kept per thread while
Django would make the same one, :func:`_cursor`), so they stay inside the caller's transaction
and are counted like any other query. The cache holds SQL *text* only:
these are not server-side prepared statements (every execution sends the text and its
parameters through the driver, like any ORM query; nothing is ``PREPARE``d on the server).

Values go in as the ORM would send them: each is prepared by its model field
(``field.get_db_prep_save(value, connection)``: JSON columns, naive datetimes, strings for
UUIDs), except values the field would send unchanged (:data:`_AS_IS`,
:data:`_AS_IS_POSTGRES`). A value that is an expression is compiled by Django's compiler for
that statement (``Now()``, lease time, is cached per database because it is on every lease;
anything else, such as ``F("x") + 1``, is compiled each time). Rows come back as the ORM
would build them: every column through the converters Django's compiler would apply (JSON
decoded; on SQLite datetimes, UUIDs, floats), then set on an instance made without
``Model.__init__`` (no ``pre_init``/``post_init`` signals: no receiver is connected to the
engine's models), marked as loaded from the database. On PostgreSQL in UTC the kept cursor
reads ``timestamptz`` with psycopg's C loader instead of Django's Python one (the same values:
:func:`_load_timestamps_in_c`).

Only the shapes the stage path needs are here; everything else stays on the ORM.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import JSONField, Model
from django.db.models.base import ModelState
from django.db.models.fields import return_None
from django.db.models.functions import Now
from django.db.models.sql import Query

M = TypeVar("M", bound=Model)

_shapes: dict[tuple[Any, ...], Any] = {}

#: Values of these Python types need no preparation for fields of these internal types
#: (``get_db_prep_save`` would return them unchanged); ``None`` is always written as ``NULL``.
_AS_IS = {
    "CharField": str,
    "TextField": str,
    "IntegerField": int,
    "BigIntegerField": int,
    "PositiveIntegerField": int,
    "PositiveBigIntegerField": int,
    "BigAutoField": int,
    "AutoField": int,
    "FloatField": float,
}

#: On PostgreSQL also these (the driver takes them natively): ``UUIDField`` values of type
#: ``uuid.UUID``, ``DateTimeField`` values of type ``datetime`` *with* a time zone (a naive
#: one goes through the field, which warns and makes it aware, as the ORM does).
_AS_IS_POSTGRES = {**_AS_IS, "UUIDField": uuid.UUID, "DateTimeField": datetime}

_local = threading.local()


def _conn() -> Any:
    """The default connection of this thread *and* context: Django keeps connections per
    asyncio context (``asgiref.local``), so code run under an event loop - an ASGI request's
    sync view, a test driving Playwright - has connections of its own in the same thread. A
    per-thread cache of the connection object would hand such code another context's
    connection, a second database session beside the one its ORM statements use (seen as
    SQLite's "database table is locked" in the admin's browser test), so it is looked up
    each time (about 2 us).
    """
    return connections[DEFAULT_DB_ALIAS]


def _cursor(conn: Any) -> Any:
    """A cursor of ``conn`` for one statement (not to be closed by the caller). Making a
    Django cursor costs about 12 us (the health check and connection checks, the driver's
    cursor, its wrapper); one per statement was about 4% of a stage's CPU. The cursor made
    last in this thread is used again while nothing that Django does in ``cursor()`` would
    come out differently: the same driver connection (not closed or replaced since), the
    same statement logging (``queries_logged``: ``CaptureQueriesContext``, ``DEBUG``) and no
    health check pending (``CONN_HEALTH_CHECKS``: after ``close_old_connections`` the next
    cursor is made by Django, which checks). Execute wrappers are looked up at each
    ``execute``, so they see every statement either way.

    PostgreSQL only: an SQLite cursor kept open can hold a shared-cache table lock (the test
    databases' ``file:memorydb_...?cache=shared``) that another connection then waits on
    ("database table is locked"); SQLite gets a cursor per statement as before.
    """
    if conn.vendor != "postgresql":
        return conn.cursor()
    kept = getattr(_local, "cursor", None)
    if (
        kept is not None
        and kept[3] is conn
        and kept[0] is conn.connection
        and kept[1] == conn.queries_logged
        and (conn.health_check_done or not conn.health_check_enabled)
    ):
        return kept[2]
    cursor = conn.cursor()
    _load_timestamps_in_c(conn, cursor)
    # the driver connection is held here, so its id is never reused while it is compared
    _local.cursor = (conn.connection, conn.queries_logged, cursor, conn)
    return cursor


def _load_timestamps_in_c(conn: Any, cursor: Any) -> None:
    """Let the kept cursor read ``timestamptz`` columns with psycopg's own loader, which
    psycopg runs in C, instead of Django's (issue 19).

    Django registers a Python subclass of psycopg's loader on every connection, to give each
    value the connection's ``timezone`` (``value.replace(tzinfo=...)``); being a subclass, it
    keeps psycopg from using its C loader, and parsing the text in Python was about 5 % of a
    stage's worker CPU (a stage reads some 40 timestamps: the run, its stage records, the
    job). Where the two give the very same value - ``USE_TZ`` with the database in UTC
    (Django's ``timezone`` is ``datetime.timezone.utc``) and the session's ``TimeZone`` is UTC,
    so psycopg too makes aware datetimes with ``datetime.timezone.utc`` - this cursor (only
    this one, only the engine's statements through it) registers psycopg's loader; otherwise
    Django's stays.
    """
    if conn.timezone is not UTC:
        return
    driver_cursor = cursor.cursor
    if driver_cursor.connection.info.parameter_status("TimeZone") != "UTC":
        return
    from psycopg.types.datetime import TimestamptzLoader

    driver_cursor.adapters.register_loader("timestamptz", TimestamptzLoader)


def _q(name: str) -> str:
    return _conn().ops.quote_name(name)


def writable(fields: Iterable[Any]) -> list[tuple[Any, str, type | None, str]]:
    """``(field, attname, type written as is, quoted column)`` per field, for this database
    (see :data:`_AS_IS`, :data:`_AS_IS_POSTGRES`); the entries :func:`db_value` takes."""
    conn = _conn()
    plain = _AS_IS_POSTGRES if conn.vendor == "postgresql" else _AS_IS
    return [(f, f.attname, plain.get(f.get_internal_type()), _q(f.column)) for f in fields]


def _is_plain(as_is: type | None, value: Any) -> bool:
    """Whether ``value`` goes to the driver unchanged for a field whose plain type is ``as_is``
    (``get_db_prep_save`` would return it unchanged)."""
    t = type(value)
    if t is as_is:
        return t is not datetime or value.tzinfo is not None
    return as_is is str and isinstance(value, str)


def db_value(entry: tuple[Any, str, type | None, str], value: Any, connection: Any) -> Any:
    """``value`` as the ORM sends it for the field of ``entry`` (from :func:`writable`):
    ``None`` and plain values unchanged, anything else through ``field.get_db_prep_save``.
    Not for expressions (``Now()``, ``F()``)."""
    if value is None or _is_plain(entry[2], value):
        return value
    return _prep_save(entry[0], value, connection)


def _prep_save(field: Any, value: Any, connection: Any) -> Any:
    """``field.get_db_prep_save(value, connection)``, the short way for a ``dict`` or ``list``
    written to a ``JSONField`` on PostgreSQL: the same ``Jsonb`` adapter, dumped by an encoder
    made once per encoder class with the arguments ``json.dumps`` passes it (the field's way
    makes a ``partial`` per value and ``json.dumps`` a new encoder per value; about 7 JSON
    values are written per stage).
    """
    if (
        type(value) in (dict, list)
        and type(field) is JSONField
        and connection.vendor == "postgresql"
    ):
        from psycopg.types.json import Jsonb

        return Jsonb(value, dumps=_json_dumps(field.encoder))
    return field.get_db_prep_save(value, connection)


_dumps_by_encoder: dict[Any, Callable[[Any], str]] = {}


def _json_dumps(encoder: Any) -> Callable[[Any], str]:
    """What ``json.dumps(value, cls=encoder)`` does, without a new encoder per value
    (``json.dumps`` itself when ``encoder`` is ``None``). An encoder keeps no state between
    ``encode`` calls, so one instance serves every thread."""
    dumps = _dumps_by_encoder.get(encoder)
    if dumps is None:
        # ``json.dumps(value, cls=encoder)`` builds ``encoder()`` with JSONEncoder's own
        # defaults, so one such instance's ``encode`` is the same function.
        dumps = json.dumps if encoder is None else encoder().encode
        _dumps_by_encoder[encoder] = dumps
    return dumps


def _write_value(
    model: type[Model], field: Any, as_is: type | None, value: Any, params: list[Any], conn: Any
) -> str:
    """The SQL for one value written to ``field`` that is neither ``None`` nor written as is
    (see the callers); its parameters are appended to ``params``.
    """
    if hasattr(value, "resolve_expression"):
        if type(value) is Now:
            return now_sql()
        sql, value_params = _compile(model, value)
        params += value_params
        return sql
    params.append(_prep_save(field, value, conn))
    return "%s"


def _compile(model: type[Model], value: Any) -> tuple[str, list[Any]]:
    """SQL and params of an expression value, as ``QuerySet.update`` would compile it."""
    query = Query(model)
    compiler = query.get_compiler(connection=_conn())
    expr = value.resolve_expression(query, allow_joins=False, for_save=True)
    sql, params = compiler.compile(expr)
    return sql, list(params)


def now_sql() -> str:
    """``Now()`` (lease time, the database's clock) as Django renders it on this database:
    PostgreSQL ``STATEMENT_TIMESTAMP()``, SQLite ``STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f',
    'NOW')`` (``%`` doubled for the cursor's parameter style).
    """
    key = ("now", _conn().vendor)
    sql = _shapes.get(key)
    if sql is None:
        from ..models import WorkflowJob

        sql, params = _compile(WorkflowJob, Now())
        assert not params
        _shapes[key] = sql
    return sql


# --- Reads --------------------------------------------------------------------------------------


def _converters(fields: Sequence[Any], table: str, connection: Any) -> list[tuple[int, list[Any]]]:
    """``[(index, converters)]``: what Django's compiler applies to each selected column
    (``connection.ops.get_db_converters`` + the field's), for the columns that have any. A
    plain ``JSONField`` (no ``decoder``) gets :func:`_json_value`, which decodes as its
    ``from_db_value`` does in fewer calls (about 20 JSON values are read per stage).
    """
    out = []
    for i, f in enumerate(fields):
        col = f.get_col(table)
        found = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
        if type(f) is JSONField and f.decoder is None and found == [f.from_db_value]:
            found = [_json_value]
        if found:
            out.append((i, found))
    return out


#: What ``json.loads(text)`` calls when given no other argument.
_decode_json = json.JSONDecoder().decode


def _json_value(value: Any, expression: Any, connection: Any) -> Any:
    """``JSONField.from_db_value`` of a plain field (no ``decoder``) for a selected column:
    ``None`` stays ``None``, text is decoded (text that is not JSON is returned as it is, as
    there), anything else goes through ``json.loads`` as there (bytes)."""
    if value is None:
        return None
    try:
        if type(value) is str:
            return _decode_json(value)
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _reader(
    model: type[Model], connection: Any
) -> tuple[str, list[str], list[tuple[int, list[Any]]]]:
    """``(column list SQL, attnames, [(index, converters)])`` for all concrete fields."""
    key = ("reader", connection.vendor, model)
    shape = _shapes.get(key)
    if shape is None:
        table = model._meta.db_table
        fields = model._meta.concrete_fields
        columns = ", ".join(f"{_q(table)}.{_q(f.column)}" for f in fields)
        converters = _converters(fields, table, connection)
        shape = _shapes[key] = (columns, [f.attname for f in fields], converters)
    return shape


def _build(
    model: type[M], attnames: list[str], converters: Any, row: Sequence[Any], connection: Any
) -> M:
    values = list(row)
    for i, funcs in converters:
        value = values[i]
        for func in funcs:
            value = func(value, None, connection)
        values[i] = value
    obj = model.__new__(model)
    obj.__dict__.update(zip(attnames, values, strict=True))
    state = obj._state = ModelState()
    state.adding = False
    state.db = connection.alias
    return obj


def _lock_clause(connection: Any, lock: str) -> str:
    """`` FOR UPDATE`` (``lock="update"``) or `` FOR UPDATE SKIP LOCKED`` (``"skip"``) where the
    database has row locks; ``""`` for ``lock=""`` and on SQLite."""
    if not lock or not connection.features.has_select_for_update:
        return ""
    if lock == "skip" and connection.features.has_select_for_update_skip_locked:
        return " FOR UPDATE SKIP LOCKED"
    return " FOR UPDATE"


def select(
    model: type[M],
    key: str,
    where: str,
    params: Sequence[Any],
    *,
    order_by: str = "",
    limit: int | None = None,
    lock: str = "",
) -> list[M]:
    """Instances of ``model`` for ``SELECT <all columns> FROM <table> WHERE <where>``.

    ``key`` names the statement's shape (the SQL is built once per key and database);
    ``where``/``order_by`` use the table's column names; ``params`` must already be prepared
    (:func:`prep`). ``lock``: ``""``, ``"update"`` (``FOR UPDATE``) or ``"skip"``
    (``FOR UPDATE SKIP LOCKED``); ignored where the database has no row locks (SQLite, where
    the ``IMMEDIATE`` transaction already holds the write lock).
    """
    connection = _conn()
    skey = ("select", connection.vendor, model, key)
    shape = _shapes.get(skey)
    if shape is None:
        columns, attnames, converters = _reader(model, connection)
        sql = f"SELECT {columns} FROM {_q(model._meta.db_table)} WHERE {where}"
        if order_by:
            sql += f" ORDER BY {order_by}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        sql += _lock_clause(connection, lock)
        shape = _shapes[skey] = (sql, attnames, converters)
    sql, attnames, converters = shape
    cursor = _cursor(connection)
    cursor.execute(sql, list(params))
    rows = cursor.fetchall()
    return [_build(model, attnames, converters, row, connection) for row in rows]


def update_first(
    model: type[M],
    key: str,
    where: str,
    params: Sequence[Any],
    *,
    order_by: str,
    values: dict[str, Any],
    bump_version: bool = False,
) -> M | None:
    """Lock and change the first row of ``model`` in ``order_by`` that matches ``where`` and
    no other transaction holds, in one statement; the changed instance, or ``None``.

    ``UPDATE <table> SET <values> WHERE <pk> = (SELECT <pk> FROM <table> WHERE <where>
    ORDER BY <order_by> LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING <all columns>`` (issue 19:
    a claim that was a ``SELECT ... FOR UPDATE SKIP LOCKED`` and an ``UPDATE`` by primary
    key). ``values``: attnames to values, prepared by their fields as :func:`update` prepares
    them; ``bump_version``: also ``version = version + 1``. ``key``, ``where``, ``params``
    and ``order_by`` as for :func:`select`. ``SKIP LOCKED`` is left out where the database has
    no row locks (SQLite, where the ``IMMEDIATE`` transaction already holds the write lock).
    """
    connection = _conn()
    names = sorted(values)
    skey = ("update_first", connection.vendor, model, key, tuple(names), bump_version)
    shape = _shapes.get(skey)
    meta = model._meta
    if shape is None:
        columns, attnames, converters = _reader(model, connection)
        table, pk = _q(meta.db_table), _q(meta.pk.column)
        entries = writable([meta.get_field(n) for n in names])
        sets = [f"{entry[3]} = %s" for entry in entries]
        if bump_version:
            sets.insert(0, f"{_q('version')} = {_q('version')} + 1")
        sql = (
            f"UPDATE {table} SET {', '.join(sets)} WHERE {pk} = (SELECT {pk} FROM {table} "
            f"WHERE {where} ORDER BY {order_by} LIMIT 1{_lock_clause(connection, 'skip')}) "
            f"RETURNING {columns}"
        )
        shape = _shapes[skey] = (sql, entries, attnames, converters)
    sql, entries, attnames, converters = shape
    set_params = [db_value(entry, values[entry[1]], connection) for entry in entries]
    cursor = _cursor(connection)
    cursor.execute(sql, set_params + list(params))
    found = cursor.fetchall()
    return _build(model, attnames, converters, found[0], connection) if found else None


def prep(model: type[Model], name: str, value: Any) -> Any:
    """``value`` prepared for a query parameter compared with ``model.name``, as
    ``filter(name=value)`` prepares it (``get_db_prep_value``); a value the field would send
    unchanged (:func:`_is_plain`: a ``uuid.UUID`` for a UUID column on PostgreSQL, a string for
    a text column) is returned as it is without asking the field, as :func:`update` does for
    its conditions.
    """
    connection = _conn()
    key = ("prep", connection.vendor, model, name)
    entry = _shapes.get(key)
    if entry is None:
        entry = _shapes[key] = writable([model._meta.get_field(name)])[0]
    if value is not None and _is_plain(entry[2], value):
        return value
    return entry[0].get_db_prep_value(value, connection, prepared=False)


def column_values(
    model: type[Model], columns: Sequence[str], key_column: str, keys: Sequence[Any]
) -> list[tuple[Any, ...]]:
    """``SELECT <columns> WHERE <key_column> IN (keys)``, each value converted as the ORM's
    ``values_list`` would.
    """
    if not keys:
        return []
    connection = _conn()
    meta = model._meta
    table = meta.db_table
    fields = [meta.get_field(c) for c in columns]
    skey = ("values", connection.vendor, model, tuple(columns), key_column)
    shape = _shapes.get(skey)
    if shape is None:
        converters = _converters(fields, table, connection)
        head = (
            f"SELECT {', '.join(_q(f.column) for f in fields)} FROM {_q(table)} "
            f"WHERE {_q(meta.get_field(key_column).column)} IN "
        )
        shape = _shapes[skey] = (head, converters)
    head, converters = shape
    key_field = meta.get_field(key_column)
    params = [key_field.get_db_prep_value(k, connection, prepared=False) for k in keys]
    cursor = _cursor(connection)
    cursor.execute(head + "(" + ", ".join(["%s"] * len(params)) + ")", params)
    rows = cursor.fetchall()
    out = []
    for row in rows:
        values = list(row)
        for i, funcs in converters:
            for func in funcs:
                values[i] = func(values[i], None, connection)
        out.append(tuple(values))
    return out


# --- Writes -------------------------------------------------------------------------------------


class Write(NamedTuple):
    """A data-modifying statement built but not sent: ``sql`` (``%s`` placeholders) and its
    ``params``. :func:`update` sends writes in its own statement (``carrying=``): on PostgreSQL
    as data-modifying ``WITH`` clauses, one round trip for all (issue 19); elsewhere one by one
    before it. Made by :func:`update_write` and :func:`insert_write`.
    """

    sql: str
    params: list[Any]


def update(
    model: type[Model],
    pk: Any,
    values: dict[str, Any],
    *,
    where: dict[str, Any] | None = None,
    bump_version: bool = False,
    carrying: Sequence[Write] = (),
) -> int:
    """``UPDATE <table> SET <values> WHERE pk = ? [AND col = ? ...]``; returns the row count
    of this update (not of the writes it carries).

    ``values``: field names to new values (prepared by their fields; expressions compiled).
    ``where``: further equality conditions (the fence: ``status``, ``attempt``).
    ``bump_version``: also ``version = version + 1`` (DM-5).
    ``carrying``: writes sent with this update, which take effect whatever its row count
    (a caller whose fence matched no row rolls its transaction back). On PostgreSQL they are
    ``WITH carried_N AS (<write>)`` clauses of this very statement: all of them see the
    transaction as it was before it, so none may touch a row another of them (or this
    update) touches. Elsewhere each is executed first, in order.
    """
    connection = _conn()
    sql, params = _update_sql(connection, model, pk, values, where, bump_version)
    cursor = _cursor(connection)
    if carrying:
        if connection.vendor == "postgresql":
            sql, params = _with(carrying, sql, params)
        else:
            for write in carrying:
                cursor.execute(write.sql, write.params)
    cursor.execute(sql, params)
    return cursor.rowcount


def send(writes: Sequence[Write]) -> None:
    """Send ``writes`` one by one (writes that have no statement to ride in)."""
    if not writes:
        return
    cursor = _cursor(_conn())
    for write in writes:
        cursor.execute(write.sql, write.params)


def _with(carrying: Sequence[Write], sql: str, params: list[Any]) -> tuple[str, list[Any]]:
    """``sql`` with ``carrying`` as its data-modifying ``WITH`` clauses (PostgreSQL)."""
    clauses = ", ".join(f"carried_{i} AS ({w.sql})" for i, w in enumerate(carrying))
    return f"WITH {clauses} {sql}", [p for w in carrying for p in w.params] + params


def update_write(
    model: type[Model],
    pk: Any,
    values: dict[str, Any],
    *,
    where: dict[str, Any] | None = None,
    bump_version: bool = False,
) -> Write:
    """The statement :func:`update` sends for these arguments, not sent."""
    return Write(*_update_sql(_conn(), model, pk, values, where, bump_version))


def _update_sql(
    connection: Any,
    model: type[Model],
    pk: Any,
    values: dict[str, Any],
    where: dict[str, Any] | None,
    bump_version: bool,
) -> tuple[str, list[Any]]:
    """``(sql, params)`` of the ``UPDATE`` (see :func:`update`)."""
    meta = model._meta
    where = where or {}
    skey = ("update", connection.vendor, model, tuple(values), tuple(where), bump_version)
    shape = _shapes.get(skey)
    if shape is None:
        fields = writable(meta.get_field(name) for name in values)
        conds = [meta.pk] + [meta.get_field(name) for name in where]
        prefix = f"UPDATE {_q(meta.db_table)} SET "
        if bump_version:
            prefix += f"{_q('version')} = {_q('version')} + 1, "
        tail = " WHERE " + " AND ".join(f"{_q(f.column)} = %s" for f in conds)
        conds = writable(conds)
        shape = _shapes[skey] = (prefix, fields, conds, tail)
    prefix, fields, conds, tail = shape
    sets: list[str] = []
    params: list[Any] = []
    for (field, _, as_is, column), value in zip(fields, values.values(), strict=True):
        # None is written as NULL in the SQL text (psycopg's client-side binding renders it so
        # anyway), which keeps the parameter lists short; plain values need no preparation.
        if value is None:
            sets.append(column + " = NULL")
        elif _is_plain(as_is, value):
            sets.append(column + " = %s")
            params.append(value)
        else:
            sets.append(
                column + " = " + _write_value(model, field, as_is, value, params, connection)
            )
    for entry, value in zip(conds, (pk, *where.values()), strict=True):
        # as ``filter(col=value)`` prepares it (``get_db_prep_value``), plain values as is
        params.append(
            value
            if _is_plain(entry[2], value)
            else entry[0].get_db_prep_value(value, connection, prepared=False)
        )
    return prefix + ", ".join(sets) + tail, params


def new(model: type[M], **values: Any) -> M:
    """An unsaved instance without ``Model.__init__``: every concrete field set from
    ``values`` (attnames) or its default. Cheaper than ``Model(**values)`` for wide rows.

    Raises:
        TypeError: a name in ``values`` is not a concrete field's attname.
    """
    constants, makers, names = _defaults(model)
    if not names.issuperset(values):
        raise TypeError(f"{model.__name__} has no fields {sorted(set(values) - names)}")
    obj = model.__new__(model)
    d = obj.__dict__
    d.update(constants)
    for name, make in makers:
        if name not in values:
            d[name] = make()
    d.update(values)
    obj._state = ModelState()
    return obj


def _defaults(
    model: type[Model],
) -> tuple[dict[str, Any], list[tuple[str, Callable[[], Any]]], frozenset[str]]:
    """``(constants, makers, attnames)`` of the concrete fields' defaults: ``constants`` maps
    the attnames whose default is the same value every time (``None``, ``""``, a non-callable
    ``default=``: what ``field.get_default()`` returns for them is that one object) to it;
    ``makers`` pairs each other attname with what ``field.get_default()`` calls (a callable
    ``default=`` such as ``dict`` or ``uuid4``, a ``db_default``), called per instance.
    Built once per model: about 90 Python calls per stage fewer than calling every field's
    default maker for every instance (issue 19).
    """
    key = ("defaults", model)
    shape = _shapes.get(key)
    if shape is None:
        constants: dict[str, Any] = {}
        makers: list[tuple[str, Callable[[], Any]]] = []
        for f in model._meta.concrete_fields:
            make = f._get_default
            if make is return_None:
                constants[f.attname] = None
            elif make is str:
                constants[f.attname] = ""
            elif f.has_default() and not callable(f.default):
                constants[f.attname] = f.default
            else:
                makers.append((f.attname, make))
        names = frozenset(constants) | {name for name, _ in makers}
        shape = _shapes[key] = (constants, makers, names)
    return shape


def insert(
    objs: Sequence[Model],
    *,
    on_conflict: tuple[Sequence[str], Sequence[str]] | None = None,
) -> None:
    """``INSERT`` the instances (one statement), like ``bulk_create``: an auto-increment
    primary key that is unset is left to the database and read back with ``RETURNING``
    (PostgreSQL, SQLite >= 3.35) into the instances; they are then marked as saved.

    ``on_conflict``: ``(unique_fields, update_fields)`` for an upsert
    (``ON CONFLICT (...) DO UPDATE SET x = EXCLUDED.x``).
    """
    if not objs:
        return
    connection = _conn()
    model = type(objs[0])
    meta = model._meta
    auto = meta.pk if getattr(meta.pk, "db_returning", False) else None  # AutoField
    returning = auto is not None and getattr(objs[0], meta.pk.attname) is None
    sql, params = _insert_sql(objs, on_conflict, returning, connection)
    cursor = _cursor(connection)
    cursor.execute(sql, params)
    ids = cursor.fetchall() if returning else None
    if ids is not None:
        assert auto is not None
        for obj, (pk,) in zip(objs, ids, strict=True):
            setattr(obj, auto.attname, pk)
    for obj in objs:
        obj._state.adding = False
        obj._state.db = connection.alias


def insert_write(
    objs: Sequence[Model],
    *,
    on_conflict: tuple[Sequence[str], Sequence[str]] | None = None,
) -> Write:
    """The statement :func:`insert` sends for these instances, not sent (for
    :func:`update`'s ``carrying``); the instances are left unsaved.

    Raises:
        ValueError: no instances, or their auto-increment primary key is unset (the
            database would make it, and only :func:`insert` reads it back).
    """
    if not objs:
        raise ValueError("insert_write() needs at least one instance")
    meta = type(objs[0])._meta
    if getattr(meta.pk, "db_returning", False) and getattr(objs[0], meta.pk.attname) is None:
        raise ValueError(f"{meta.object_name}: an unset auto primary key needs insert()")
    sql, params = _insert_sql(objs, on_conflict, False, _conn())
    return Write(sql, params)


def _insert_sql(
    objs: Sequence[Model],
    on_conflict: tuple[Sequence[str], Sequence[str]] | None,
    returning: bool,
    connection: Any,
) -> tuple[str, list[Any]]:
    """``(sql, params)`` of the ``INSERT`` of ``objs`` (see :func:`insert`)."""
    model = type(objs[0])
    meta = model._meta
    skey = ("insert", connection.vendor, model, returning, _freeze(on_conflict))
    shape = _shapes.get(skey)
    if shape is None:
        columns = [f for f in meta.concrete_fields if not (returning and f is meta.pk)]
        fields = writable(columns)
        head = (
            f"INSERT INTO {_q(meta.db_table)} ({', '.join(_q(f.column) for f in columns)}) VALUES "
        )
        tail = ""
        if on_conflict is not None:
            unique, updates = on_conflict
            tail += (
                f" ON CONFLICT({', '.join(_q(meta.get_field(u).column) for u in unique)})"
                " DO UPDATE SET "
                + ", ".join(
                    f"{_q(meta.get_field(u).column)} = EXCLUDED.{_q(meta.get_field(u).column)}"
                    for u in updates
                )
            )
        if returning:
            if not connection.features.can_return_rows_from_bulk_insert:
                raise NotImplementedError("INSERT ... RETURNING is not available")
            tail += f" RETURNING {_q(meta.pk.column)}"
        shape = _shapes[skey] = (head, fields, tail)
    head, fields, tail = shape
    groups: list[str] = []
    params: list[Any] = []
    for obj in objs:
        d = obj.__dict__
        marks = []
        for field, attname, as_is, _ in fields:
            value = d[attname]
            if value is None:  # as in update()
                marks.append("NULL")
            elif _is_plain(as_is, value):
                marks.append("%s")
                params.append(value)
            else:
                marks.append(_write_value(model, field, as_is, value, params, connection))
        groups.append("(" + ", ".join(marks) + ")")
    return head + ", ".join(groups) + tail, params


def _freeze(on_conflict: tuple[Sequence[str], Sequence[str]] | None) -> Any:
    return None if on_conflict is None else (tuple(on_conflict[0]), tuple(on_conflict[1]))


def ids_clause(column: str, ids: Iterable[Any]) -> tuple[str, list[Any]]:
    """``column NOT IN (%s, ...)`` for a non-empty list of ids (``("", [])`` when empty)."""
    ids = list(ids)
    if not ids:
        return "", []
    return f" AND {_q(column)} NOT IN ({', '.join(['%s'] * len(ids))})", ids
