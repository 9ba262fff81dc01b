"""The 5-field cron parser, pinned case by case (issue 17 section 5): day of week (0 and 7 are
Sunday, names), cronie's day rule (the day fields are ORed only when both are restricted
without a leading ``*``; else ANDed), names in any case, ranges, steps, lists, leap days and
DST in a zone. Every expected time is written out; none is computed by the code under test.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from django_workflows import ScheduleDefinitionError, define_schedule


def times(cron: str, start: str, count: int = 5, tz: str = "UTC") -> list[str]:
    """The first ``count`` firings strictly after ``start`` (ISO, in ``tz``), as local
    ``YYYY-MM-DD HH:MM`` texts (with the weekday, ``Mon``, to make the day rule readable)."""
    zone = ZoneInfo(tz)
    schedule = define_schedule("cron-test", "wf", cron=cron, tz=tz)
    current = datetime.fromisoformat(start).replace(tzinfo=zone)
    out = []
    for _ in range(count):
        found = schedule.next_after(current)
        assert found is not None, (cron, out)
        out.append(found.astimezone(zone).strftime("%a %Y-%m-%d %H:%M"))
        current = found
    return out


CASES = [
    # --- day of week: 0 and 7 are Sunday; names; ranges across the week ---
    (
        "0 0 * * 0",
        "2025-06-01 00:00",
        3,
        ["Sun 2025-06-08 00:00", "Sun 2025-06-15 00:00", "Sun 2025-06-22 00:00"],
    ),
    ("0 0 * * 7", "2025-06-01 00:00", 2, ["Sun 2025-06-08 00:00", "Sun 2025-06-15 00:00"]),
    ("0 0 * * sun", "2025-06-01 00:00", 1, ["Sun 2025-06-08 00:00"]),
    (
        "0 0 * * 5-7",
        "2025-06-02 00:00",
        4,
        [
            "Fri 2025-06-06 00:00",
            "Sat 2025-06-07 00:00",
            "Sun 2025-06-08 00:00",
            "Fri 2025-06-13 00:00",
        ],
    ),
    (
        "0 9 * * mon-fri",
        "2025-06-06 10:00",
        3,
        ["Mon 2025-06-09 09:00", "Tue 2025-06-10 09:00", "Wed 2025-06-11 09:00"],
    ),
    (
        "0 9 * * MON,Wed,fRi",
        "2025-06-09 09:00",
        3,
        ["Wed 2025-06-11 09:00", "Fri 2025-06-13 09:00", "Mon 2025-06-16 09:00"],
    ),
    # --- month names in any case, ranges of names ---
    ("0 0 1 JAN,jul *", "2025-02-01 00:00", 2, ["Tue 2025-07-01 00:00", "Thu 2026-01-01 00:00"]),
    (
        "0 0 1 feb-apr *",
        "2025-03-01 00:00",
        3,
        ["Tue 2025-04-01 00:00", "Sun 2026-02-01 00:00", "Sun 2026-03-01 00:00"],
    ),
    # --- both day fields restricted without a leading *: a day matches either ---
    (
        "0 0 13 * fri",
        "2025-06-01 00:00",
        4,
        [
            "Fri 2025-06-06 00:00",
            "Fri 2025-06-13 00:00",
            "Fri 2025-06-20 00:00",
            "Fri 2025-06-27 00:00",
        ],
    ),
    (
        "0 0 1,15 * 1",
        "2025-06-01 00:00",
        4,
        [
            "Mon 2025-06-02 00:00",
            "Mon 2025-06-09 00:00",
            "Sun 2025-06-15 00:00",
            "Mon 2025-06-16 00:00",
        ],
    ),
    (
        "0 0 1-31/10 * 1",
        "2025-06-01 00:00",
        4,
        [
            "Mon 2025-06-02 00:00",
            "Mon 2025-06-09 00:00",
            "Wed 2025-06-11 00:00",
            "Mon 2025-06-16 00:00",
        ],
    ),
    # --- a day field with a leading * (cronie, Vixie cron): both must match ---
    (
        "0 0 */2 * 1",
        "2025-06-01 00:00",
        4,
        [
            "Mon 2025-06-09 00:00",
            "Mon 2025-06-23 00:00",
            "Mon 2025-07-07 00:00",
            "Mon 2025-07-21 00:00",
        ],
    ),
    # */2 of 0-7 is Sun, Tue, Thu, Sat: the 1st of a month that falls on one of them
    (
        "0 0 1 * */2",
        "2025-06-01 00:00",
        3,
        ["Tue 2025-07-01 00:00", "Sat 2025-11-01 00:00", "Thu 2026-01-01 00:00"],
    ),
    ("0 0 * * 1", "2025-06-01 00:00", 2, ["Mon 2025-06-02 00:00", "Mon 2025-06-09 00:00"]),
    ("0 0 13 * *", "2025-06-01 00:00", 2, ["Fri 2025-06-13 00:00", "Sun 2025-07-13 00:00"]),
    # --- steps, ranges, lists in the time fields ---
    (
        "*/20 * * * *",
        "2025-06-01 00:05",
        4,
        [
            "Sun 2025-06-01 00:20",
            "Sun 2025-06-01 00:40",
            "Sun 2025-06-01 01:00",
            "Sun 2025-06-01 01:20",
        ],
    ),
    (
        "10-50/20 3 * * *",
        "2025-06-01 00:00",
        4,
        [
            "Sun 2025-06-01 03:10",
            "Sun 2025-06-01 03:30",
            "Sun 2025-06-01 03:50",
            "Mon 2025-06-02 03:10",
        ],
    ),
    (
        "5/30 0 * * *",
        "2025-06-01 00:00",
        3,
        ["Sun 2025-06-01 00:05", "Sun 2025-06-01 00:35", "Mon 2025-06-02 00:05"],
    ),
    (
        "0 8-10,17 * * *",
        "2025-06-01 00:00",
        5,
        [
            "Sun 2025-06-01 08:00",
            "Sun 2025-06-01 09:00",
            "Sun 2025-06-01 10:00",
            "Sun 2025-06-01 17:00",
            "Mon 2025-06-02 08:00",
        ],
    ),
    (
        "0 0 */10 * *",
        "2025-06-01 00:00",
        4,
        [
            "Wed 2025-06-11 00:00",
            "Sat 2025-06-21 00:00",
            "Tue 2025-07-01 00:00",
            "Fri 2025-07-11 00:00",
        ],
    ),
    # --- month ends and leap days ---
    (
        "0 0 31 * *",
        "2025-01-31 00:00",
        3,
        ["Mon 2025-03-31 00:00", "Sat 2025-05-31 00:00", "Thu 2025-07-31 00:00"],
    ),
    ("0 0 29 2 *", "2025-01-01 00:00", 2, ["Tue 2028-02-29 00:00", "Sun 2032-02-29 00:00"]),
    ("0 0 29 2 *", "2096-03-01 00:00", 1, ["Fri 2104-02-29 00:00"]),  # 2100 is not a leap year
    ("0 0 29 2 */7", "2025-01-01 00:00", 2, ["Sun 2032-02-29 00:00", "Sun 2060-02-29 00:00"]),
    (
        "0 0 29 2 1",
        "2025-02-20 00:00",
        3,
        ["Mon 2025-02-24 00:00", "Mon 2026-02-02 00:00", "Mon 2026-02-09 00:00"],
    ),
    # --- aliases ---
    ("@weekly", "2025-06-01 00:00", 1, ["Sun 2025-06-08 00:00"]),
    ("@MONTHLY", "2025-06-01 00:00", 1, ["Tue 2025-07-01 00:00"]),
    ("@yearly", "2025-06-01 00:00", 1, ["Thu 2026-01-01 00:00"]),
]


@pytest.mark.parametrize(
    ("cron", "start", "count", "expected"), CASES, ids=[f"{c[0]} from {c[1]}" for c in CASES]
)
def test_cron_times(cron: str, start: str, count: int, expected: list[str]) -> None:
    assert times(cron, start, count) == expected


def test_0_7_and_sun_name_the_same_day() -> None:
    assert times("0 0 * * 0", "2025-06-01 00:00") == times("0 0 * * 7", "2025-06-01 00:00")
    assert times("0 0 * * 0", "2025-06-01 00:00") == times("0 0 * * SUN", "2025-06-01 00:00")


@pytest.mark.parametrize(
    ("cron", "tz", "start", "expected"),
    [
        # Spring forward in Berlin (30 March 2025, 02:00 -> 03:00): 02:30 fires at 03:00.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2025-03-29 03:00",
            ["Sun 2025-03-30 03:00", "Mon 2025-03-31 02:30"],
        ),
        # Fall back in Berlin (26 October 2025, 03:00 -> 02:00): 02:30 fires once.
        (
            "30 2 * * *",
            "Europe/Berlin",
            "2025-10-25 03:00",
            ["Sun 2025-10-26 02:30", "Mon 2025-10-27 02:30"],
        ),
        # New York's spring forward (9 March 2025): the hourly cron has no 02:00.
        (
            "0 * * * *",
            "America/New_York",
            "2025-03-09 00:30",
            ["Sun 2025-03-09 01:00", "Sun 2025-03-09 03:00", "Sun 2025-03-09 04:00"],
        ),
        # A weekday rule is read on the zone's calendar: Monday in Tokyo is Sunday in UTC.
        ("0 1 * * mon", "Asia/Tokyo", "2025-06-01 00:00", ["Mon 2025-06-02 01:00"]),
    ],
)
def test_cron_in_a_zone_across_dst(cron: str, tz: str, start: str, expected: list[str]) -> None:
    assert times(cron, start, len(expected), tz=tz) == expected


def test_a_weekday_in_a_zone_is_its_own_calendar_day_in_utc() -> None:
    schedule = define_schedule("cron-test", "wf", cron="0 1 * * mon", tz="Asia/Tokyo")
    first = schedule.next_after(datetime(2025, 6, 1, tzinfo=UTC))
    assert first == datetime(2025, 6, 1, 16, 0, tzinfo=UTC)  # Sunday 16:00 UTC


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("0 0 30 2 *", "never fires"),
        ("0 0 31 4,6,9,11 *", "never fires"),
        ("0 0 31 2 */2", "never fires"),  # a leading *: both fields, and 31 February never is
        ("60 * * * *", "minute field: 60 is out of range 0-59"),
        ("0 24 * * *", "hour field: 24 is out of range 0-23"),
        ("0 0 0 * *", "day of month field: 0 is out of range 1-31"),
        ("0 0 * 13 *", "month field: 13 is out of range 1-12"),
        ("0 0 * * 8", "day of week field: 8 is out of range 0-7"),
        ("0 0 * * funday", "day of week field: 'funday' is not a number"),
        ("0 0 * jan-dex *", "month field: 'dex' is not a number"),
        ("*/0 * * * *", "minute field: step '0' must be a positive number"),
        ("0 0 * * 5-1", "day of week field: range '5-1' runs backwards"),
        ("0 0 1 nov-feb *", "month field: range 'nov-feb' runs backwards"),
        ("0 0 * *", "has 4 fields; expected 5"),
        ("@reboot", "is not supported"),
    ],
)
def test_bad_cron_names_the_field(cron: str, message: str) -> None:
    with pytest.raises(ScheduleDefinitionError, match=message) as info:
        define_schedule("cron-test", "wf", cron=cron)
    assert info.value.field == "cron"


def test_the_day_fields_are_anded_when_either_starts_with_a_star() -> None:
    """cronie's rule, the one case croniter reads otherwise: ``*/2`` in the day-of-month field
    with a weekday fires only on Mondays that are odd days of the month; without the leading
    ``*`` (``1-31/2``) the fields are ORed: every odd day and every Monday."""
    anded = times("0 0 */2 * 1", "2025-06-01 00:00", 10)
    assert all(t.startswith("Mon ") and int(t[12:14]) % 2 == 1 for t in anded), anded
    ored = times("0 0 1-31/2 * 1", "2025-06-01 00:00", 6)
    assert ored == [
        "Mon 2025-06-02 00:00",
        "Tue 2025-06-03 00:00",
        "Thu 2025-06-05 00:00",
        "Sat 2025-06-07 00:00",
        "Mon 2025-06-09 00:00",
        "Wed 2025-06-11 00:00",
    ]
